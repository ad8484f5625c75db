//! Queue and waiting: FIFO by the queue key's create revision, work-conserving and herd-free.
//!
//! A waiter is its queue key alone; its marker (`request/{rk}`) is only ever its grant. A
//! release hands its slot straight to the oldest waiter, in its own transaction (see
//! `release`), and writes the grant into that waiter's marker: a waiter learns of its grant from
//! one watch event on its own marker (watched from the revision after its join, so a grant made
//! before the watch was in place is replayed). The event is the grant as
//! the transaction wrote it: checked by key, by the waiter's own session and by a revision after
//! its join, it is taken without a read. A marker found by a read instead (after a watch was
//! set up again) is checked against its slot key first. While every slot is held that is all a
//! waiter watches; no waiter reads the pool, and a hand-off costs one event, to the grantee's
//! process alone.
//!
//! A slot can be free while someone waits only after a free without a hand-off: a holder's
//! session expired, or a release found the queue empty just before a waiter joined. Each broker
//! with waiters watches the slot keys for deletions (one watch per broker on its shared stream,
//! see `slots`), and a deletion makes its waiters look; a waiter that joins reads which slots
//! are held as it joins. When a waiter sees fewer slots held than the pool has, it looks for its
//! predecessor: the head (no predecessor) claims a free slot and grants the others to the
//! waiters behind it, in queue order, in parallel transactions (one round trip); any other
//! waiter watches its predecessor until it is the head or the pool is full again.
//!
//! A waiter keeps its place through outages and leader elections (its calls retry on any
//! member, without a bound) and fails only when etcd says its session expired.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    WatchOptions,
};
use futures_util::future::join_all;
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

use super::error::{EtcdError, EtcdErrorKind, Fail};
use super::layout::{Confirmed, Layout, Marker, MarkerState, Raw, Waiter, oldest_waiters, raws};
use super::records::Session;
use super::release::{CHAIN_MAX, merge};
use super::txn::{Grant, gets, held_in, revision_of, slot_keys, txn_shape};
use super::watches::{Seen, Watch, event_kind};
use crate::inner::Inner;

/// A place in the queue.
#[derive(Debug, Clone)]
pub(super) struct Ticket {
    pub(super) rk: u64,
    /// Its place key (names its queue key).
    pub(super) qk: u64,
    /// The queue key's create revision: the place.
    pub(super) rev: i64,
    pub(super) session: Arc<Session>,
}

/// What a waiter read about itself.
#[derive(Debug, Clone)]
pub(super) struct Look {
    /// Its request marker (none while it waits: the marker is only ever its grant, or its
    /// tombstone).
    pub(super) marker: Option<Marker>,
    /// Whether its queue key exists.
    pub(super) queued: bool,
    /// The next older waiter: `None` when not read (the pool was full), `Some(None)` for the
    /// head.
    pub(super) predecessor: Option<Option<Waiter>>,
    /// How many of the pool's slot keys exist (each a held slot; keys under `slot/` that are
    /// not exactly slot keys are not counted).
    pub(super) held: i64,
    /// The marker came from an event of the waiter's own marker watch (the transaction that
    /// wrote it, as it happened), not from a read.
    pub(super) seen: bool,
    /// The waiters a grant in the marker names after the grantee (see `release`).
    pub(super) next: Vec<Waiter>,
}

impl Look {
    /// What a waiter knows right after joining, from the join's own transaction: it is
    /// queued (without a marker), and `held` slots are held.
    pub(super) fn joined(held: i64) -> Look {
        Look {
            marker: None,
            queued: true,
            predecessor: None,
            held,
            seen: false,
            next: Vec::new(),
        }
    }

    /// What a watch event on the waiter's marker says (nothing about the slots).
    fn of_marker(marker: Marker, next: Vec<Waiter>) -> Look {
        Look {
            marker: Some(marker),
            queued: false,
            predecessor: None,
            held: 0,
            seen: true,
            next,
        }
    }

    /// A look from its reads (pure, so that every read a waiter acts on goes through it):
    /// the waiter's marker, whether its queue key exists, how many slot keys exist, and (when
    /// read) the queue key just older than its own.
    pub(super) fn read(
        layout: &Layout,
        marker: Option<Raw<'_>>,
        queued: bool,
        held: i64,
        predecessor: Option<Option<Raw<'_>>>,
    ) -> Result<Look, EtcdError> {
        Ok(Look {
            next: marker.map_or_else(Vec::new, |kv| layout.next_of(kv.value)),
            marker: marker.map(|kv| layout.marker(kv)).transpose()?,
            queued,
            predecessor: predecessor
                .map(|p| p.map(|kv| layout.waiter(kv)).transpose())
                .transpose()?,
            held,
            seen: false,
        })
    }
}

/// What a waiter does next, decided from a [`Look`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Next {
    /// It holds `slot`, granted at `revision`.
    Granted { slot: u32, revision: i64 },
    /// It has no marker and no queue key: its session expired (or someone deleted its
    /// records).
    Gone,
    /// Its marker lives under another lease than the waiter's session: leasehold did not
    /// write it for this waiter, and whatever it says grants nothing.
    NotOurs { lease: i64 },
    /// Its marker is a tombstone: it was given up.
    Abandoned,
    /// Every slot is held: wait for a grant (or a slot deletion).
    Wait,
    /// A slot may be free: find out where it stands in the queue.
    LookCloser,
    /// A slot may be free and it is the head: claim.
    Head,
    /// A slot may be free, and it waits behind `predecessor` (a place key).
    Behind { predecessor: u64 },
}

/// Pure: what a waiter of session `session` does next. A grant is only ever decided from a
/// marker under the waiter's own session (and is then checked against its slot key, see
/// `Layout::confirm_grant`); a waiter has no marker, only its queue key; it waits only while
/// all `capacity` slot keys exist: a wait that a slot's release (a hand-off) or deletion ends.
/// (Keys under `slot/` that are not slot keys are not counted, so they never make a free pool
/// look full.)
pub(super) fn decide(look: &Look, capacity: u32, session: i64) -> Next {
    if let Some(marker) = look.marker {
        if marker.lease != session {
            return Next::NotOurs {
                lease: marker.lease,
            };
        }
        return match marker.state {
            MarkerState::Granted { slot } => Next::Granted {
                slot,
                revision: marker.mod_rev,
            },
            MarkerState::Abandoned => Next::Abandoned,
        };
    }
    if !look.queued {
        return Next::Gone;
    }
    if look.held >= i64::from(capacity) {
        return Next::Wait;
    }
    match &look.predecessor {
        None => Next::LookCloser,
        Some(None) => Next::Head,
        Some(Some(p)) => Next::Behind { predecessor: p.qk },
    }
}

impl Inner {
    /// Waits in the queue until granted. `stream` is the waiter's marker watch if it was opened
    /// before the join (then `look` is what the join read); otherwise it is opened here and the
    /// waiter looks after it. Cancel safe in the sense the acquire guard needs: a dropped wait
    /// leaves its place to the guard's cleanup.
    pub(super) async fn wait(
        self: &Arc<Self>,
        ticket: Ticket,
        mut stream: Option<WaitStream>,
        joined: Option<Look>,
    ) -> Result<Grant, EtcdError> {
        let _watching_slots = self.slots_user();
        let mut frees = self.frees.subscribe();
        frees.mark_unchanged();
        let mut look = match (&stream, joined) {
            (Some(_), Some(look)) => look,
            _ => {
                // The stream first (its marker watch from now), then the look: a grant made
                // before the watch began is in the look, any later one comes as an event.
                if stream.is_none() {
                    stream = self.open_watch(&ticket).await?;
                }
                self.look(&ticket, false).await?
            }
        };
        loop {
            // Local releases so far: one after this can free an index the head could not take.
            let releases = self.releases.load(Ordering::Acquire);
            let session = ticket.session.id;
            let predecessor = match decide(&look, self.layout.capacity(), session) {
                Next::Granted { slot, revision } if look.seen && revision > ticket.rev => {
                    // The grant as it happened: the event of this waiter's own marker watch,
                    // written under its own session after it joined (`decide` grants only from
                    // one under its session). The transaction that wrote it wrote the slot key
                    // under the same session at the same revision (see `release`); no read.
                    self.granted_here(ticket.rev, &look.next);
                    return Ok(Grant {
                        slot,
                        revision,
                        session: Arc::clone(&ticket.session),
                    });
                }
                Next::Granted { slot, revision } => {
                    // Read, not seen: the marker may be older than the slot key's last change.
                    // Its slot key says whether the grant still stands.
                    let marker = Marker {
                        state: MarkerState::Granted { slot },
                        lease: session,
                        mod_rev: revision,
                    };
                    return match self.confirm(&ticket, &marker).await? {
                        Confirmed::Held => {
                            self.granted_here(ticket.rev, &look.next);
                            Ok(Grant {
                                slot,
                                revision,
                                session: Arc::clone(&ticket.session),
                            })
                        }
                        Confirmed::Missing => Err(self.gone(&ticket).await),
                    };
                }
                Next::NotOurs { lease } => {
                    return Err(self.layout.not_ours(ticket.rk, lease, session));
                }
                Next::Gone => return Err(self.gone(&ticket).await),
                Next::Abandoned => {
                    return Err(EtcdError::new(
                        EtcdErrorKind::InvalidResponse,
                        format!("request {:016x} was given up while it waited", ticket.rk),
                    ));
                }
                Next::LookCloser => {
                    look = self.look(&ticket, true).await?;
                    continue;
                }
                Next::Head => {
                    if let Some(grant) = self.claim_as_head(&ticket).await? {
                        return Ok(grant);
                    }
                    // Nothing this broker may take (an index it still holds), or someone was
                    // quicker: look again; if nothing changed, wait for a change.
                    let again = self.look(&ticket, true).await?;
                    let same = decide(&again, self.layout.capacity(), session) == Next::Head
                        && again.held == look.held;
                    look = again;
                    if !same {
                        continue;
                    }
                    None
                }
                Next::Wait => None,
                Next::Behind { predecessor } => Some(predecessor),
            };
            let free = look.held < i64::from(self.layout.capacity());
            look = self
                .watch_for_change(
                    &ticket,
                    predecessor,
                    free.then_some(releases),
                    &mut stream,
                    &mut frees,
                )
                .await?;
        }
    }

    /// A waiter of this broker that joined at `joined` was granted, by a grant that names
    /// `next`, the waiters after it that its releaser knew. Every waiter older than it has been
    /// served or has left (grants follow the queue's order), so none of them is worth a link of
    /// the next release's chain; those named are added. When fewer than a chain's worth are
    /// known, the oldest waiters are read in the background, off the release's path.
    pub(super) fn granted_here(self: &Arc<Self>, joined: i64, next: &[Waiter]) {
        let short = {
            let mut heads = self.heads.lock();
            merge(&mut heads, next);
            heads.retain(|w| w.create_rev > joined);
            heads.len() < CHAIN_MAX
        };
        if short {
            self.refresh_heads();
        }
    }

    /// Reads the grant's slot key, and checks it says what the marker does (see
    /// `Layout::confirm_grant`).
    async fn confirm(
        self: &Arc<Self>,
        ticket: &Ticket,
        marker: &Marker,
    ) -> Result<Confirmed, EtcdError> {
        let MarkerState::Granted { slot } = marker.state else {
            return Err(txn_shape("confirm a grant"));
        };
        let key = self.layout.slot_key(slot);
        let read = self
            .patiently(ticket, "read the granted slot", |mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        self.layout.confirm_grant(
            ticket.rk,
            ticket.session.id,
            marker,
            read.kvs().first().map(Raw::from),
        )
    }

    /// Why a waiter's marker (or its grant's slot key) is gone: its session expired, or someone
    /// deleted its records. Only etcd's word ends the session: a time-to-live of zero or less
    /// (etcd's answer for a lease it does not know), "lease not found", or the keeper having
    /// heard the same. When etcd does not answer (the question is retried on any member until
    /// `retry_for`, like every bounded call), the wait ends `ETCD_UNAVAILABLE` and the session
    /// is kept: it may well live, with what the broker holds under it, which its keeper renews
    /// and `close` must still revoke.
    async fn gone(self: &Arc<Self>, ticket: &Ticket) -> EtcdError {
        let id = ticket.session.id;
        // The tests cut etcd off when they see this, to make the question go unanswered.
        tracing::debug!(
            request = format_args!("{:016x}", ticket.rk),
            session = format_args!("{id:016x}"),
            "a waiter's place is gone: etcd is asked whether its session lives"
        );
        let ttl = self
            .endpoints
            .call(
                "check the session",
                Instant::now() + self.retry_for,
                |mut c| async move { c.lease_time_to_live(id, None).await },
            )
            .await;
        match ttl {
            Ok(resp) if resp.ttl() > 0 => EtcdError::new(
                EtcdErrorKind::InvalidResponse,
                format!(
                    "the records of request {:016x} were deleted by someone else",
                    ticket.rk
                ),
            ),
            Ok(_) | Err(Fail::NotFound) => self.confirmed_expiry(ticket),
            Err(_) if ticket.session.is_expired() => self.confirmed_expiry(ticket),
            Err(Fail::Ambiguous(why)) => EtcdError::new(
                EtcdErrorKind::Unavailable,
                format!(
                    "waiting in the queue: the place of request {:016x} is gone, and etcd did not \
                     say within {:?} whether session {id:016x} lives: {why}",
                    ticket.rk, self.retry_for
                ),
            ),
            Err(Fail::Fatal(e)) => e,
        }
    }

    /// A waiter's session is gone, as etcd said: the next acquire grants a new one.
    fn confirmed_expiry(&self, ticket: &Ticket) -> EtcdError {
        self.forget_session(&ticket.session);
        ticket.session.expired_error("waiting in the queue")
    }

    /// Reads the waiter's marker, its queue key and how many slots are held (and, `closer`, its
    /// predecessor: a read of the queue), in one read, retried on any member while the session
    /// lives.
    pub(super) async fn look(
        self: &Arc<Self>,
        ticket: &Ticket,
        closer: bool,
    ) -> Result<Look, EtcdError> {
        let l = &self.layout;
        // The predecessor: the youngest queue key older than this waiter's. Keys under
        // `queue/` that are not queue keys are skipped; a few are read so that one stray key
        // does not cost a second read.
        let older = |limit: i64| {
            TxnOp::get(
                l.queue_prefix(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_max_create_revision(ticket.rev - 1)
                        .with_sort(SortTarget::Create, SortOrder::Descend)
                        .with_limit(limit),
                ),
            )
        };
        let mut ops = vec![
            TxnOp::get(l.request_key(ticket.rk), None),
            TxnOp::get(
                l.queue_key(ticket.qk),
                Some(GetOptions::new().with_keys_only()),
            ),
            slot_keys(l),
        ];
        if closer {
            ops.push(older(PREDECESSOR_READ));
        }
        let txn = Txn::new().and_then(ops);
        let resp = self
            .patiently(ticket, "look at the queue", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        let reads = gets(&resp.op_responses());
        let (marker, queued, slots) = match reads.as_slice() {
            [m, q, s, ..] if reads.len() == 3 + usize::from(closer) => (m, q, s),
            _ => return Err(txn_shape("look at the queue")),
        };
        let mut older_read = reads.get(3).cloned();
        if let Some(read) = &older_read
            && read.more()
            && !read.kvs().iter().any(|kv| l.is_queue_key(kv.key()))
        {
            // Only stray keys among those read: read them all.
            let all = older(0);
            let again = self
                .patiently(ticket, "look for the predecessor", |mut c| {
                    let txn = Txn::new().and_then([all.clone()]);
                    async move { c.txn(txn).await }
                })
                .await?;
            older_read = gets(&again.op_responses()).into_iter().next();
        }
        Look::read(
            l,
            marker.kvs().first().map(Raw::from),
            !queued.kvs().is_empty(),
            held_in(l, slots),
            older_read.as_ref().map(|p| {
                p.kvs()
                    .iter()
                    .find(|kv| l.is_queue_key(kv.key()))
                    .map(Raw::from)
            }),
        )
    }

    /// One call, retried without a bound while the waiter's session lives: a waiter keeps its
    /// place through an outage or a leader election.
    async fn patiently<T, F, Fut>(
        self: &Arc<Self>,
        ticket: &Ticket,
        what: &str,
        mut f: F,
    ) -> Result<T, EtcdError>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        loop {
            if ticket.session.is_expired() {
                return Err(ticket.session.expired_error(what));
            }
            match self
                .endpoints
                .call(what, Instant::now() + self.retry_for, &mut f)
                .await
            {
                Ok(v) => return Ok(v),
                Err(Fail::Ambiguous(why)) => {
                    tracing::debug!(what, error = %why, "a waiter keeps its place while etcd does not answer");
                }
                Err(Fail::NotFound) => return Err(ticket.session.expired_error(what)),
                Err(Fail::Fatal(e)) => return Err(e),
            }
        }
    }

    /// The head's move when slots may be free: read the holders, claim a free slot, and grant
    /// the other free slots to the waiters behind, in order. `None` when it got nothing.
    async fn claim_as_head(self: &Arc<Self>, ticket: &Ticket) -> Result<Option<Grant>, EtcdError> {
        let l = &self.layout;
        let slots = self
            .patiently(ticket, "read the holders", |mut c| {
                let prefix = l.slot_prefix();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let taken: HashSet<u32> = l
            .holders(raws(slots.kvs()))?
            .iter()
            .map(|h| h.index)
            .collect();
        let local: HashSet<u32> = self.held.lock().keys().map(|t| t.slot_id()).collect();
        let free: Vec<u32> = (0..l.capacity())
            .filter(|i| !taken.contains(i) && !local.contains(i))
            .collect();
        match free.as_slice() {
            [] => Ok(None),
            [only] => self.claim(ticket, *only).await,
            _ => {
                let n = free.len() as i64;
                let first = self
                    .patiently(ticket, "read the queue's head", |mut c| {
                        let prefix = l.queue_prefix();
                        async move { c.get(prefix, Some(oldest_waiters(n))).await }
                    })
                    .await?;
                let waiters = l.waiters(raws(first.kvs()))?;
                if waiters.first().map(|w| w.rk) != Some(ticket.rk) {
                    return self.claim(ticket, free[0]).await;
                }
                let others = waiters[1..]
                    .iter()
                    .zip(&free[1..])
                    .map(|(w, slot)| self.grant_to(w.clone(), *slot));
                let (mine, _) = futures_util::join!(self.claim(ticket, free[0]), join_all(others));
                mine
            }
        }
    }

    /// Claims `slot` for the waiter if it is still free and the waiter still queued.
    async fn claim(
        self: &Arc<Self>,
        ticket: &Ticket,
        slot: u32,
    ) -> Result<Option<Grant>, EtcdError> {
        let l = &self.layout;
        let under = || Some(PutOptions::new().with_lease(ticket.session.id));
        let txn = Txn::new()
            .when([
                Compare::create_revision(l.queue_key(ticket.qk), CompareOp::Equal, ticket.rev),
                Compare::create_revision(l.slot_key(slot), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(l.slot_key(slot), l.holder_value(ticket.rk), under()),
                TxnOp::delete(l.queue_key(ticket.qk), None),
                TxnOp::put(
                    l.request_key(ticket.rk),
                    l.marker_value(MarkerState::Granted { slot }),
                    under(),
                ),
            ]);
        // A retry after a lost answer fails the comparison (the queue key is gone); the look
        // that follows finds the grant in the marker.
        let resp = self
            .patiently(ticket, "claim a free slot", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Ok(None);
        }
        // A claim that landed but whose answer is malformed fails the acquire: its guard
        // passes the slot on.
        let revision = revision_of(resp.header().map(|h| h.revision()), "claim a free slot")?;
        self.granted_here(ticket.rev, &[]);
        Ok(Some(Grant {
            slot,
            revision,
            session: Arc::clone(&ticket.session),
        }))
    }

    /// Grants `slot` to `waiter` (another request, maybe of another process) if it is still
    /// free and the waiter still queued. Best effort: a failure leaves it to the next head.
    pub(super) async fn grant_to(self: &Arc<Self>, waiter: Waiter, slot: u32) {
        let l = &self.layout;
        let under = || Some(PutOptions::new().with_lease(waiter.lease));
        let txn = Txn::new()
            .when([
                Compare::create_revision(
                    l.queue_key(waiter.qk),
                    CompareOp::Equal,
                    waiter.create_rev,
                ),
                Compare::create_revision(l.slot_key(slot), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(l.slot_key(slot), l.holder_value(waiter.rk), under()),
                TxnOp::delete(l.queue_key(waiter.qk), None),
                TxnOp::put(
                    l.request_key(waiter.rk),
                    l.marker_value(MarkerState::Granted { slot }),
                    under(),
                ),
            ]);
        let _ = self
            .endpoints
            .call(
                "grant a slot to the next waiter",
                Instant::now() + self.retry_for,
                |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                },
            )
            .await;
    }

    /// Waits for what may change the waiter's decision, and returns what to decide from next:
    /// the grant written into its marker, or a fresh look once its predecessor changed
    /// (`predecessor`), a slot was deleted, a local release happened (`releases`, when a slot
    /// may be free), or the broker's watch stream was set up again.
    async fn watch_for_change(
        self: &Arc<Self>,
        ticket: &Ticket,
        predecessor: Option<u64>,
        releases: Option<u64>,
        stream: &mut Option<WaitStream>,
        frees: &mut watch::Receiver<u64>,
    ) -> Result<Look, EtcdError> {
        let Some(s) = stream.as_mut() else {
            // A new watch of the marker, from now: look again after it, for what happened
            // while there was none.
            *stream = self.open_watch(ticket).await?;
            return self.look(ticket, false).await;
        };
        if s.predecessor() != predecessor {
            s.next = None;
            if let Some(qk) = predecessor {
                // From now, then checked: the predecessor may have left before the watch.
                let key = self.layout.queue_key(qk);
                let watch = match self.hub.watch(key.clone(), WatchOptions::new(), None).await {
                    Ok(watch) => watch,
                    Err(_) => return self.look(ticket, false).await,
                };
                s.next = Some((qk, watch));
                let still = self
                    .patiently(ticket, "look at the predecessor", |mut c| {
                        let key = key.clone();
                        async move { c.get(key, Some(GetOptions::new().with_count_only())).await }
                    })
                    .await?;
                if still.count() == 0 {
                    return self.look(ticket, false).await;
                }
            }
        }
        // A slot index this broker held may become free for it (its token released here after
        // etcd had already let it go). Armed before the count is compared.
        let released = self.released.notified();
        tokio::pin!(released);
        released.as_mut().enable();
        if releases.is_some_and(|r| self.releases.load(Ordering::Acquire) != r) {
            return self.look(ticket, false).await;
        }
        {
            let next = async {
                match s.next.as_mut() {
                    Some((_, watch)) => watch.seen.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(next);
            loop {
                tokio::select! {
                    () = &mut released, if releases.is_some() => {
                        return self.look(ticket, false).await;
                    }
                    changed = frees.changed() => {
                        if changed.is_ok() {
                            return self.look(ticket, false).await;
                        }
                    }
                    seen = s.marker.seen.recv() => match seen {
                        Some(Seen::Events(events)) => {
                            for event in &events {
                                let Some(kv) = event.kv() else { continue };
                                if kv.key() != self.layout.request_key(ticket.rk).as_bytes() {
                                    continue; // not this watch's key: etcd routes by watch id
                                }
                                // A kind it does not know is read again, like a deletion.
                                if event_kind(event) == Some(EventType::Put) {
                                    // Checked like any read: decided by `decide` (its own
                                    // session's, or refused).
                                    let marker = self.layout.marker(kv)?;
                                    let next = self.layout.next_of(kv.value());
                                    return Ok(Look::of_marker(marker, next));
                                }
                                return self.look(ticket, false).await; // its marker went: why?
                            }
                        }
                        // Set up again on a new stream, or cancelled by etcd: look again.
                        Some(Seen::Reset) => return self.look(ticket, false).await,
                        None => break,
                    },
                    _ = &mut next => {
                        // The predecessor moved on (or its watch was set up again).
                        return self.look(ticket, false).await;
                    }
                    () = ticket.session.expired() => {
                        return Err(ticket.session.expired_error("waiting in the queue"));
                    }
                }
            }
        }
        // The hub dropped the watch (the broker is closing): a new one next time.
        *stream = None;
        self.look(ticket, false).await
    }

    /// Watches a waiter's marker, from now, on the broker's shared stream, retried while the
    /// session lives. `None` if the session expired meanwhile (the caller's look will say so).
    ///
    /// From now, not from the revision of a read: etcd serves a watch that starts in the past
    /// from a loop that catches up every 100 ms (and re-reads history to do so), which would
    /// delay the grant's event. The caller looks after it instead (or set it up before the
    /// join).
    pub(super) async fn open_watch(
        self: &Arc<Self>,
        ticket: &Ticket,
    ) -> Result<Option<WaitStream>, EtcdError> {
        let session = Arc::clone(&ticket.session);
        self.open_marker_watch(ticket.rk, &session, None).await
    }

    /// [`open_watch`](Self::open_watch) by request key; `from` a revision instead of now (an
    /// acquire opens it right after its join, from the revision after it: nothing is missed,
    /// and the join's own write is not sent back).
    pub(super) async fn open_marker_watch(
        self: &Arc<Self>,
        rk: u64,
        session: &Session,
        from: Option<i64>,
    ) -> Result<Option<WaitStream>, EtcdError> {
        let key = self.layout.request_key(rk);
        let mut backoff = Duration::from_millis(20);
        loop {
            if session.is_expired() {
                return Ok(None);
            }
            match self.hub.watch(key.clone(), WatchOptions::new(), from).await {
                Ok(marker) => return Ok(Some(WaitStream { marker, next: None })),
                Err(Fail::Fatal(e)) => return Err(e),
                Err(f) => {
                    tracing::debug!(error = ?f, "a waiter keeps its place while etcd does not answer");
                }
            }
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }
}

/// How many queue keys older than its own a waiter reads to find its predecessor (more only
/// when all of them are keys that are not queue keys).
const PREDECESSOR_READ: i64 = 4;

/// A waiter's watches on the broker's shared stream: its marker's, and its predecessor's (with
/// its place key) while it has one.
pub(super) struct WaitStream {
    marker: Watch,
    next: Option<(u64, Watch)>,
}

impl WaitStream {
    fn predecessor(&self) -> Option<u64> {
        self.next.as_ref().map(|(qk, _)| *qk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(
        marker: Option<MarkerState>,
        queued: bool,
        predecessor: Option<Option<u64>>,
        held: i64,
    ) -> Look {
        Look {
            next: Vec::new(),
            marker: marker.map(|state| Marker {
                state,
                lease: 7,
                mod_rev: 9,
            }),
            queued,
            predecessor: predecessor.map(|p| {
                p.map(|qk| Waiter {
                    qk,
                    rk: qk + 100,
                    lease: 8,
                    create_rev: 5,
                })
            }),
            held,
            seen: false,
        }
    }

    /// The waiter's session in these looks.
    const SESSION: i64 = 7;

    fn decide_(look: &Look, capacity: u32) -> Next {
        decide(look, capacity, SESSION)
    }

    #[test]
    fn while_every_slot_is_held_a_waiter_only_waits_for_its_grant() {
        for predecessor in [None, Some(None), Some(Some(3))] {
            assert_eq!(decide_(&look(None, true, predecessor, 2), 2), Next::Wait);
        }
    }

    #[test]
    fn with_a_slot_free_a_waiter_finds_its_place_and_only_the_head_claims() {
        let waiting = None;
        assert_eq!(decide_(&look(waiting, true, None, 1), 2), Next::LookCloser);
        assert_eq!(decide_(&look(waiting, true, Some(None), 1), 2), Next::Head);
        assert_eq!(
            decide_(&look(waiting, true, Some(Some(3)), 1), 2),
            Next::Behind { predecessor: 3 }
        );
    }

    #[test]
    fn a_grant_in_the_marker_wins_over_anything_else_the_look_says() {
        assert_eq!(
            decide_(
                &look(
                    Some(MarkerState::Granted { slot: 1 }),
                    false,
                    Some(Some(3)),
                    1
                ),
                2
            ),
            Next::Granted {
                slot: 1,
                revision: 9
            }
        );
    }

    #[test]
    fn missing_or_inconsistent_records_end_the_wait() {
        assert_eq!(decide_(&look(None, false, None, 0), 2), Next::Gone);
        assert_eq!(decide_(&look(None, false, Some(None), 0), 2), Next::Gone);
        assert_eq!(
            decide_(&look(Some(MarkerState::Abandoned), false, None, 0), 2),
            Next::Abandoned
        );
    }

    #[test]
    fn a_marker_under_another_lease_grants_nothing_whatever_it_says() {
        for state in [MarkerState::Granted { slot: 0 }, MarkerState::Abandoned] {
            let look = look(Some(state), true, Some(None), 0);
            assert_eq!(decide(&look, 2, SESSION + 1), Next::NotOurs { lease: 7 });
        }
    }
}
