//! The idempotent acquire: one transaction that claims a slot on an idle pool or joins the
//! queue, named by the request key so that a retry (of a call whose answer was lost, or of the
//! whole acquire with the same request id) finds its own work instead of taking a second slot;
//! and what an acquire that ends without a grant (dropped, failed, refused) leaves: nothing.
//!
//! The first transaction is guarded by the request's marker (`request/{rk}`, written only by a
//! grant or a give-up) and its queue place: it acts only when neither exists, and otherwise only
//! reads them back (a queue key of this request under this session: it joined). So a copy of
//! it that arrives late, or a retry after a lost answer, cannot queue or claim twice. An acquire given up writes the marker
//! as a tombstone (`abandoned`) in the same transaction that removes its queue place, which
//! fences any late copy of its first transaction; a slot it was granted meanwhile is passed on.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use parking_lot::Mutex;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use super::error::{EtcdError, EtcdErrorKind, Fail};
use super::layout::{Confirmed, MarkerState, Raw, place_key, request_key};
use super::queue::{Look, Ticket};
use super::records::{Claim, Cleanup, CleanupPhase, Held, Session};
pub(super) use super::txn::{Grant, gets, held_in, revision_of, slot_keys, txn_shape};
use crate::inner::Inner;
use leasehold::{AcquireRequest, SlotToken};

/// What the first transaction found or did.
enum First {
    Granted(Grant),
    /// Queued; what the join read, if it did (then the marker's watch starts after it).
    Queued(Ticket, Option<Look>),
    /// Something left by an earlier attempt was cleared: send the first transaction again.
    Again,
    /// The idle pool's claim found the pool busy: join the queue.
    Busy,
}

/// The attempt of one request in flight; its end (drop) wakes the copies waiting for it.
struct Flight {
    inner: Arc<Inner>,
    rk: u64,
    _done: tokio::sync::watch::Sender<()>,
}

impl Drop for Flight {
    fn drop(&mut self) {
        // Removed before `_done` drops (fields drop after this), so that a woken copy finds
        // no flight left and boards its own.
        self.inner.flights.lock().remove(&self.rk);
    }
}

/// Cleans up after an acquire that is dropped (or fails) without handing out its grant.
struct AcquireGuard {
    inner: Arc<Inner>,
    rk: u64,
    armed: bool,
}

impl Drop for AcquireGuard {
    fn drop(&mut self) {
        if self.armed {
            self.inner.abandon_in_background(self.rk);
        }
    }
}

impl Inner {
    pub(super) fn request_key(&self, request: &AcquireRequest) -> u64 {
        request_key(self.owner, request.origin(), request.request_id())
    }

    /// Takes a slot for `request`: at once on an idle pool, else after waiting in the queue.
    pub(super) async fn acquire(
        self: &Arc<Self>,
        request: &AcquireRequest,
    ) -> Result<SlotToken, EtcdError> {
        // `close` waits for this acquire to end, and for the cleanup it starts (dropped last).
        let _in_flight = self.tasks.token();
        let rk = self.request_key(request);
        loop {
            if self.closed.is_cancelled() {
                return Err(self.closed_error());
            }
            // A retry of an acquire that succeeded: the same grant, while it is held.
            if let Some(token) = self.token_of(rk) {
                return Ok(token);
            }
            // A retry of an acquire whose grant is being given back: that grant is being
            // handed on and must not be handed out again (it would be held twice).
            if self.settles(rk) {
                return Err(EtcdError::new(
                    EtcdErrorKind::RequestSettling,
                    format!(
                        "request {rk:016x} was granted and released, and its release is still being finished: use a new request id"
                    ),
                ));
            }
            // One attempt per request at a time. A copy of the request sent while another runs
            // waits for it to end, then returns its grant if it is held (above) or tries
            // itself: never the grant of an attempt whose token was released meanwhile.
            let flight = match self.board(rk) {
                Ok(flight) => flight,
                Err(mut other) => {
                    tokio::select! {
                        _ = other.changed() => {}
                        () = self.closed.cancelled() => {}
                    }
                    continue;
                }
            };
            return self.attempt(request, rk, flight).await;
        }
    }

    /// Registers the attempt of request `rk`, or hands back the one in flight to wait for.
    fn board(self: &Arc<Self>, rk: u64) -> Result<Flight, tokio::sync::watch::Receiver<()>> {
        let mut flights = self.flights.lock();
        if let Some(other) = flights.get(&rk) {
            return Err(other.clone());
        }
        let (done, waiting) = tokio::sync::watch::channel(());
        flights.insert(rk, waiting);
        Ok(Flight {
            inner: Arc::clone(self),
            rk,
            _done: done,
        })
    }

    /// One attempt of request `rk`, alone in flight.
    async fn attempt(
        self: &Arc<Self>,
        request: &AcquireRequest,
        rk: u64,
        flight: Flight,
    ) -> Result<SlotToken, EtcdError> {
        // Ends the flight after the guard below has started its cleanup: a copy that waits
        // for this attempt finds that cleanup (`take_over`).
        let _flight = flight;
        self.take_over(rk).await?;
        let mut guard = AcquireGuard {
            inner: Arc::clone(self),
            rk,
            armed: true,
        };
        let result = tokio::select! {
            result = async {
                loop {
                    let grant = self.obtain(rk).await?;
                    if let Some(token) = self.park(grant, rk, request.origin()).await? {
                        return Ok(token);
                    }
                    // Handed on: back to the queue.
                }
            } => result,
            // Closing: the attempt is dropped where it is, and its guard withdraws it.
            () = self.closed.cancelled() => Err(self.closed_error()),
        };
        match &result {
            Ok(_) => {
                guard.armed = false;
                self.free_place(rk);
            }
            Err(e) if e.is_pool_refusal() => {
                // The pool is unusable: give back anything this request holds before answering,
                // so that the refusal grants nothing, not even for a moment after it.
                guard.armed = false;
                let bound = self.rpc_timeout * 2;
                match timeout(bound, self.abandon(rk)).await {
                    Ok(Ok(())) => self.free_place(rk),
                    _ => self.abandon_in_background(rk),
                }
            }
            Err(_) => {} // the guard cleans up in the background
        }
        result
    }

    /// The queue place of request `rk`: the one it already has, or a free one.
    pub(super) fn place_of(&self, rk: u64) -> u64 {
        let mut places = self.places.lock();
        let index = match places.by_request.get(&rk) {
            Some(index) => *index,
            None => {
                let index = match places.free.pop() {
                    Some(index) => index,
                    None => {
                        places.next += 1;
                        places.next - 1
                    }
                };
                places.by_request.insert(rk, index);
                index
            }
        };
        place_key(self.owner, index)
    }

    /// Request `rk`'s queue place, if it has one.
    pub(super) fn place_if_any(&self, rk: u64) -> Option<u64> {
        let places = self.places.lock();
        places
            .by_request
            .get(&rk)
            .map(|index| place_key(self.owner, *index))
    }

    /// Frees request `rk`'s queue place: its queue key is gone (granted, never created, or
    /// removed by its cleanup).
    pub(super) fn free_place(&self, rk: u64) {
        let mut places = self.places.lock();
        if let Some(index) = places.by_request.remove(&rk) {
            places.free.push(index);
        }
    }

    /// Takes request `rk`'s queue place away from it without freeing it: its key is live and
    /// not this request's. The index is never handed out again by this broker (one place lost
    /// per such key; the key itself goes with whoever's session it is under).
    fn retire_place(&self, rk: u64) {
        self.places.lock().by_request.remove(&rk);
    }

    fn token_of(&self, rk: u64) -> Option<SlotToken> {
        self.held
            .lock()
            .iter()
            .find(|(_, h)| h.rk == rk && h.claim != Claim::Expired)
            .map(|(t, _)| *t)
    }

    /// The first transaction, then the queue until a grant.
    async fn obtain(self: &Arc<Self>, rk: u64) -> Result<Grant, EtcdError> {
        let deadline = Instant::now() + self.retry_for;
        let mut again = 0;
        let mut slots = None;
        let mut join = false;
        loop {
            let session = self.session(deadline).await?;
            // On a busy pool this acquire will wait: the broker's watch of slot deletions goes
            // first, so that a slot freed right after the join is not missed.
            if join || self.contended.load(Ordering::Relaxed) {
                let user = slots.get_or_insert_with(|| self.slots_user());
                user.ready(self.rpc_timeout).await;
            }
            match self.first(rk, &session, join, deadline).await {
                Ok(First::Granted(grant)) => return Ok(grant),
                Ok(First::Queued(ticket, joined)) => {
                    // Its marker's watch, from the revision after the join: a grant made
                    // meanwhile is replayed, and the join's own write is not sent back.
                    #[cfg(feature = "fault-injection")]
                    {
                        let mut hold = self.hold_watches.subscribe();
                        let _ = hold.wait_for(|held| !*held).await;
                    }
                    let stream = match joined {
                        Some(_) => {
                            self.open_marker_watch(rk, &session, Some(ticket.rev + 1))
                                .await?
                        }
                        None => None,
                    };
                    return self.wait(ticket, stream, joined).await;
                }
                Ok(First::Busy) => join = true,
                Ok(First::Again) if again < 3 => again += 1,
                Ok(First::Again) => {
                    return Err(EtcdError::new(
                        EtcdErrorKind::InvalidResponse,
                        "the request's records keep changing under it",
                    ));
                }
                // The session expired under the transaction (nothing was written): a new one.
                Err(Fail::NotFound) if again < 3 => {
                    again += 1;
                    self.forget_session(&session);
                }
                Err(f) => return Err(f.into_etcd("claim a slot or join the queue")),
            }
        }
    }

    /// A session etcd no longer knows: the next call grants a new one.
    pub(super) fn forget_session(&self, session: &Arc<Session>) {
        let mut current = self.session.lock();
        if current.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *current = None;
        }
    }

    /// A slot index likely free to try first: not one this broker holds a token for.
    fn guess(&self) -> Option<u32> {
        let capacity = self.layout.capacity();
        let held = self.held.lock();
        let hint = self.hint.load(Ordering::Relaxed);
        (0..capacity)
            .map(|k| hint.wrapping_add(k) % capacity)
            .find(|i| !held.keys().any(|t| t.slot_id() == *i))
    }

    /// The first transaction: if the request has no marker yet, claim a likely-free slot when
    /// nobody waits, and otherwise join the queue (reading the place just taken). If it has one,
    /// read it back instead. Idempotent: a retry of it reads what the first copy did.
    async fn first(
        self: &Arc<Self>,
        rk: u64,
        session: &Arc<Session>,
        join: bool,
        deadline: Instant,
    ) -> Result<First, Fail> {
        let l = &self.layout;
        let qk = self.place_of(rk);
        let under = || Some(PutOptions::new().with_lease(session.id));
        // On a pool seen busy, straight to the queue: "nobody waits" compares the whole queue,
        // and someone does. Either way is correct (a waiter that finds a slot free takes it).
        let guess = if join || self.contended.load(Ordering::Relaxed) {
            None
        } else {
            self.guess()
        };
        // Acts only while the request has no marker and the capacity record is this pool's:
        // else it reads back (a retry, a late copy, a corrupt record).
        let mut when = vec![
            Compare::version(l.request_key(rk), CompareOp::Equal, 0),
            Compare::value(l.capacity_key(), CompareOp::Equal, l.capacity_value()),
        ];
        let then = match guess {
            // Claim slot `g` if nobody waits and it is free: one flat transaction (a nested
            // "claim, else join" costs etcd more on every acquire of an idle pool).
            Some(g) => {
                // An empty range compares as one absent key: "nobody waits".
                when.push(Compare::version(l.queue_prefix(), CompareOp::Equal, 0).with_prefix());
                when.push(Compare::create_revision(l.slot_key(g), CompareOp::Equal, 0));
                vec![
                    TxnOp::put(l.slot_key(g), l.holder_value(rk), under()),
                    TxnOp::put(
                        l.request_key(rk),
                        l.marker_value(MarkerState::Granted { slot: g }),
                        under(),
                    ),
                ]
            }
            // Join the queue (its queue key alone: a request has no marker while it waits),
            // reading which slot keys exist (the held slots).
            None => {
                // Never over a live key: a place this broker freed may still hold a key
                // (see `retire_place`), and a put would keep its create revision (its place
                // in the queue) under this request.
                when.push(Compare::create_revision(
                    l.queue_key(qk),
                    CompareOp::Equal,
                    0,
                ));
                vec![
                    TxnOp::put(l.queue_key(qk), l.waiter_value(self.owner, rk), under()),
                    slot_keys(l),
                ]
            }
        };
        let txn = Txn::new().when(when).and_then(then).or_else([
            TxnOp::get(l.request_key(rk), None),
            TxnOp::get(l.queue_key(qk), None),
            TxnOp::get(l.capacity_key(), None),
        ]);
        let resp = self
            .endpoints
            .call("claim a slot or join the queue", deadline, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        let ops = resp.op_responses();
        if resp.succeeded() {
            let revision = revision_of(
                resp.header().map(|h| h.revision()),
                "claim a slot or join the queue",
            )
            .map_err(Fail::Fatal)?;
            let Some(slot) = guess else {
                // Queued.
                self.contended.store(true, Ordering::Relaxed);
                let held = match gets(&ops).as_slice() {
                    [slots] => Some(held_in(l, slots)),
                    _ => None,
                };
                return Ok(First::Queued(
                    Ticket {
                        rk,
                        qk,
                        rev: revision,
                        session: Arc::clone(session),
                    },
                    held.map(Look::joined),
                ));
            };
            self.heads.lock().clear();
            self.hint
                .store((slot + 1) % l.capacity(), Ordering::Relaxed);
            return Ok(First::Granted(Grant {
                slot,
                revision,
                session: Arc::clone(session),
            }));
        }
        // The request already has a marker, or the capacity record is not ours.
        let reads = gets(&ops);
        let [marker, queued, capacity] = reads.as_slice() else {
            return Err(Fail::Fatal(txn_shape("read the request back")));
        };
        l.check_capacity(capacity.kvs().first().map(Raw::from))
            .map_err(Fail::Fatal)?;
        let Some(marker_kv) = marker.kvs().first() else {
            if guess.is_some() {
                // Someone waits, or the guessed slot is taken: join the queue.
                self.contended.store(true, Ordering::Relaxed);
                return Ok(First::Busy);
            }
            // A request that waits has no marker: its queue key says it joined (an earlier
            // copy of this transaction whose answer was lost).
            if let Some(kv) = queued.kvs().first()
                && let Ok(waiter) = l.waiter(kv)
                && waiter.rk == rk
                && waiter.lease == session.id
            {
                return Ok(First::Queued(
                    Ticket {
                        rk,
                        qk,
                        rev: kv.create_revision(),
                        session: Arc::clone(session),
                    },
                    None,
                ));
            }
            if !queued.kvs().is_empty() {
                // The place holds a key that is not this request's (a cleanup of this broker's
                // that could not reach etcd, or someone else's write): never written over.
                tracing::warn!(
                    request = format_args!("{rk:016x}"),
                    key = l.queue_key(qk),
                    "a queue place of this broker holds a live key: the request takes another place"
                );
                self.retire_place(rk);
            }
            return Ok(First::Again); // removed in between, or another place
        };
        let found = l.marker(marker_kv).map_err(Fail::Fatal)?;
        let stale = found.lease != session.id || found.state == MarkerState::Abandoned;
        match found.state {
            _ if stale => {}
            MarkerState::Granted { slot } => {
                let key = l.slot_key(slot);
                let resp = self
                    .endpoints
                    .call("read the request's slot", deadline, |mut c| {
                        let key = key.clone();
                        async move { c.get(key, None).await }
                    })
                    .await?;
                // Only a grant its slot key confirms (a slot gone with an earlier attempt
                // starts afresh below; one that says otherwise is refused).
                let slot_kv = resp.kvs().first().map(Raw::from);
                if l.confirm_grant(rk, session.id, &found, slot_kv)
                    .map_err(Fail::Fatal)?
                    == Confirmed::Held
                {
                    return Ok(First::Granted(Grant {
                        slot,
                        revision: found.mod_rev,
                        session: Arc::clone(session),
                    }));
                }
            }
            MarkerState::Abandoned => {}
        }
        // A tombstone of an earlier attempt (its cleanup is over: `take_over` waited for it),
        // or a marker whose queue place or slot is gone: remove it, then start afresh.
        let key = l.request_key(rk);
        let clear = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                found.mod_rev,
            )])
            .and_then([TxnOp::delete(key, None)]);
        self.endpoints
            .call("clear an earlier attempt's marker", deadline, |mut c| {
                let clear = clear.clone();
                async move { c.txn(clear).await }
            })
            .await?;
        Ok(First::Again)
    }

    /// Hands the grant to the caller, once this broker holds no other token for its slot index
    /// (a token whose lease was lost while its job winds down): the supervisor would refuse a
    /// duplicate slot. That wait is bounded ([`Inner::margin`]): a job that does not wind down
    /// must not keep the slot idle, so the grant is then handed on to the next waiter, like a
    /// release, and `None` sends the request back to the queue.
    async fn park(
        self: &Arc<Self>,
        grant: Grant,
        rk: u64,
        origin: u64,
    ) -> Result<Option<SlotToken>, EtcdError> {
        let token = SlotToken::new(grant.slot, grant.revision as u64);
        // A grant after an outage may come before the session's next renewal: renew first, so
        // that the holder's keep-alive does not report the lease lost at once.
        if !grant
            .session
            .refresh(self.ttl, self.ttl - self.margin())
            .await
        {
            return Err(grant.session.expired_error("handing out a grant"));
        }
        let handed_on_at = Instant::now() + self.margin();
        loop {
            // Armed before `held` is read: a release in between still wakes this.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut held = self.held.lock();
                if !held.keys().any(|t| t.slot_id() == grant.slot) {
                    let since = Instant::now();
                    held.insert(
                        token,
                        Held {
                            rk,
                            origin,
                            session: Arc::clone(&grant.session),
                            claim: Claim::Unclaimed { since, ever: false },
                            lost: false,
                        },
                    );
                    drop(held);
                    self.watch_unclaimed(token, since);
                    return Ok(Some(token));
                }
            }
            tracing::debug!(%token, "granted a slot index this broker still holds: waiting for it");
            tokio::select! {
                () = &mut released => {}
                () = grant.session.expired() => {
                    return Err(grant.session.expired_error("waiting for a local release"));
                }
                () = sleep_until(handed_on_at) => {
                    tracing::info!(%token, "granted a slot index whose earlier token here has not been released: the grant is handed on");
                    let entry = Held {
                        rk,
                        origin,
                        session: Arc::clone(&grant.session),
                        claim: Claim::Expired,
                        lost: false,
                    };
                    // Retried while the session lives; the request's marker goes with it, so
                    // the request joins the queue afresh.
                    self.settle(token, entry, false).await;
                    return Ok(None);
                }
            }
        }
    }

    /// Lets a retry of `rk` proceed: takes back the cleanup of an earlier attempt if it has not
    /// started, or waits for it to finish.
    async fn take_over(&self, rk: u64) -> Result<(), EtcdError> {
        loop {
            let Some(ctl) = self.abandoned.lock().get(&rk).cloned() else {
                return Ok(());
            };
            let mut done = ctl.done.subscribe();
            {
                let mut phase = ctl.phase.lock();
                if *phase == CleanupPhase::Pending {
                    *phase = CleanupPhase::Cancelled;
                    drop(phase);
                    forget_cleanup(&self.abandoned, rk, &ctl);
                    return Ok(());
                }
            }
            if timeout(self.retry_for, done.wait_for(|d| *d))
                .await
                .is_err()
            {
                return Err(EtcdError::new(
                    EtcdErrorKind::Unavailable,
                    format!(
                        "an earlier attempt of this request ({rk:016x}) is still being cleaned up"
                    ),
                ));
            }
            forget_cleanup(&self.abandoned, rk, &ctl);
        }
    }

    /// Starts the cleanup of request `rk` in the background (an acquire dropped or failed).
    pub(super) fn abandon_in_background(self: &Arc<Self>, rk: u64) {
        // Dropped where no runtime is current: the broker's own (if it is gone, so is the
        // session's keeper, and the session lapses with everything under it).
        let rt = tokio::runtime::Handle::try_current().unwrap_or_else(|_| self.rt.clone());
        let ctl = Arc::new(Cleanup {
            phase: Mutex::new(CleanupPhase::Pending),
            done: tokio::sync::watch::Sender::new(false),
        });
        if let Some(earlier) = self.abandoned.lock().insert(rk, Arc::clone(&ctl)) {
            // One cleanup per request at a time; never leave a retry waiting on the old one.
            earlier.done.send_replace(true);
        }
        let me = Arc::clone(self);
        // Tracked: `close` waits for it (a task nothing waits for dies with the runtime, and
        // leaves the queue place to the session's TTL).
        self.tasks.spawn_on(async move {
            // Settles the record even if this task is dropped (runtime shutdown).
            let _settled = SettleOnDrop {
                inner: Arc::clone(&me),
                rk,
                ctl: Arc::clone(&ctl),
            };
            {
                let mut phase = ctl.phase.lock();
                if *phase == CleanupPhase::Cancelled {
                    return;
                }
                *phase = CleanupPhase::Running;
            }
            // No give-up while the session lives: it is renewed until the broker closes, so
            // a queue key left under it would stay the oldest waiter and be handed slots that
            // nobody takes. It ends when the cleanup is done, when the session is gone (its
            // keys with it: `abandon` answers `Ok`), or when `close` revokes the session.
            let mut backoff = Duration::from_millis(100);
            let mut failures = 0u32;
            loop {
                let outcome = match timeout(me.retry_for, me.abandon(rk)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(EtcdError::new(
                        EtcdErrorKind::Unavailable,
                        format!("no answer within {:?}", me.retry_for),
                    )),
                };
                let Err(e) = outcome else {
                    break;
                };
                failures += 1;
                if failures == 1 || failures.is_power_of_two() {
                    tracing::warn!(request = format_args!("{rk:016x}"), error = %e, failures, "abandoned etcd acquire not cleaned up yet; retried while its session lives");
                }
                tokio::select! {
                    () = sleep(backoff) => {}
                    // `close` revoked the session, or gives up on it: nothing is left.
                    () = me.closing.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            // The place is free only once its key is gone (a join also never writes over a
            // live key: see `first`).
            me.free_place(rk);
        }, &rt);
    }

    /// Removes what request `rk` left: its queue place (its marker becomes a tombstone, which
    /// fences a late copy of its first transaction), or the slot it was granted meanwhile,
    /// which is passed on like a release.
    async fn abandon(self: &Arc<Self>, rk: u64) -> Result<(), EtcdError> {
        let Some(session) = self.session.lock().clone() else {
            return Ok(()); // no session: nothing of this broker's is in etcd
        };
        let l = &self.layout;
        let deadline = Instant::now() + self.retry_for;
        let key = l.request_key(rk);
        let tomb = TxnOp::put(
            key.clone(),
            l.marker_value(MarkerState::Abandoned),
            Some(PutOptions::new().with_lease(session.id)),
        );
        // Only the place this request holds: a freed place may be another request's now.
        let place = self.place_if_any(rk);
        let read = Txn::new().and_then([TxnOp::get(key.clone(), None)]);
        // Read, act on what was read under a comparison, read again: every step is idempotent
        // (a lost answer's retry fails its comparison), and a late copy of the first
        // transaction that lands in between is seen by the next read.
        for _ in 0..8 {
            if session.is_expired() {
                return Ok(()); // its keys went with it
            }
            let resp = match self
                .endpoints
                .call("read an abandoned request", deadline, |mut c| {
                    let read = read.clone();
                    async move { c.txn(read).await }
                })
                .await
            {
                Ok(resp) => resp,
                Err(f) => return Err(f.into_etcd("read an abandoned request")),
            };
            let reads = gets(&resp.op_responses());
            let marker = match reads.first().and_then(|g| g.kvs().first()) {
                None => None,
                Some(kv) => match l.marker(kv) {
                    Ok(m) if m.lease == session.id => Some(m),
                    other => {
                        // Not a marker this broker wrote (a neighbour rewrote it, or wrote one
                        // leasehold refuses): it is left alone, but this request's own queue
                        // place goes, so that nobody waits behind it and no release hands it a
                        // slot.
                        tracing::warn!(
                            request = format_args!("{rk:016x}"),
                            marker = ?other,
                            "an abandoned etcd acquire's marker was not written by this broker; only its queue place is withdrawn"
                        );
                        if let Some(qk) = place {
                            self.withdraw_place(qk, session.id, deadline).await?;
                        }
                        return Ok(());
                    }
                },
            };
            let step = match marker {
                Some(m) if m.state == MarkerState::Abandoned => {
                    self.clear_tombstone_later(rk, m.mod_rev);
                    tracing::debug!(
                        request = format_args!("{rk:016x}"),
                        "abandoned etcd acquire cleaned up"
                    );
                    return Ok(());
                }
                Some(m) => {
                    if let MarkerState::Granted { slot } = m.state {
                        // Granted meanwhile: pass the slot on, leaving the tombstone.
                        let token = SlotToken::new(slot, m.mod_rev as u64);
                        let entry = Held {
                            rk,
                            origin: 0,
                            session: Arc::clone(&session),
                            claim: Claim::Expired,
                            lost: false,
                        };
                        match self
                            .give_back(token, &entry, Some(session.id), deadline)
                            .await
                        {
                            Ok(_) | Err(Fail::NotFound) => {}
                            Err(f) => return Err(f.into_etcd("pass on an abandoned grant")),
                        }
                    }
                    // A grant passed on (or whose slot had moved on): leave the queue.
                    let mut ops = vec![tomb.clone()];
                    ops.extend(place.map(|qk| TxnOp::delete(l.queue_key(qk), None)));
                    Txn::new()
                        .when([Compare::mod_revision(
                            key.clone(),
                            CompareOp::Equal,
                            m.mod_rev,
                        )])
                        .and_then(ops)
                }
                // Never got that far (or not yet): fence a late first transaction. (A queue
                // place without its marker, whose marker someone deleted, goes too.)
                None => {
                    let mut ops = vec![tomb.clone()];
                    ops.extend(place.map(|qk| TxnOp::delete(l.queue_key(qk), None)));
                    Txn::new()
                        .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
                        .and_then(ops)
                }
            };
            match self
                .endpoints
                .call("leave the queue", deadline, |mut c| {
                    let step = step.clone();
                    async move { c.txn(step).await }
                })
                .await
            {
                Ok(_) => {}
                Err(Fail::NotFound) => return Ok(()), // the session expired: nothing is left
                Err(f) => return Err(f.into_etcd("leave the queue")),
            }
        }
        Err(EtcdError::new(
            EtcdErrorKind::Unavailable,
            format!("request {rk:016x}: its records kept changing while it was given up"),
        ))
    }

    /// Deletes queue place `qk` if it is still under this broker's session `lease`.
    async fn withdraw_place(
        self: &Arc<Self>,
        qk: u64,
        lease: i64,
        deadline: Instant,
    ) -> Result<(), EtcdError> {
        let key = self.layout.queue_key(qk);
        let txn = Txn::new()
            .when([Compare::lease(key.clone(), CompareOp::Equal, lease)])
            .and_then([TxnOp::delete(key, None)]);
        match self
            .endpoints
            .call("leave the queue", deadline, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
        {
            Ok(_) | Err(Fail::NotFound) => Ok(()),
            Err(f) => Err(f.into_etcd("leave the queue")),
        }
    }

    /// Removes a tombstone once no late copy of the request's first transaction can still
    /// arrive (its calls were bounded by the call timeout long before). A close ends it: the
    /// revoke removes the tombstone with the session.
    fn clear_tombstone_later(self: &Arc<Self>, rk: u64, tomb_rev: i64) {
        let inner = Arc::downgrade(self);
        let after = (self.retry_for + self.ttl) * 2;
        let closed = self.closed.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = sleep(after) => {}
                () = closed.cancelled() => return,
            }
            let Some(me) = inner.upgrade() else {
                return;
            };
            let key = me.layout.request_key(rk);
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    tomb_rev,
                )])
                .and_then([TxnOp::delete(key, None)]);
            let _ = me
                .endpoints
                .call(
                    "clear a tombstone",
                    Instant::now() + me.retry_for,
                    |mut c| {
                        let txn = txn.clone();
                        async move { c.txn(txn).await }
                    },
                )
                .await;
        });
    }
}

/// Ends a cleanup's record when its task ends, however it ends.
struct SettleOnDrop {
    inner: Arc<Inner>,
    rk: u64,
    ctl: Arc<Cleanup>,
}

impl Drop for SettleOnDrop {
    fn drop(&mut self) {
        {
            let mut phase = self.ctl.phase.lock();
            if *phase != CleanupPhase::Cancelled {
                *phase = CleanupPhase::Done;
            }
        }
        self.ctl.done.send_replace(true);
        forget_cleanup(&self.inner.abandoned, self.rk, &self.ctl);
    }
}

/// Removes `ctl` from the table, unless a newer record for the request replaced it.
fn forget_cleanup(table: &Mutex<HashMap<u64, Arc<Cleanup>>>, rk: u64, ctl: &Arc<Cleanup>) {
    let mut table = table.lock();
    if table.get(&rk).is_some_and(|c| Arc::ptr_eq(c, ctl)) {
        table.remove(&rk);
    }
}
