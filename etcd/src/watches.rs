//! One watch stream per broker, shared by all its waiters: a waiter's watch is one message on
//! the stream (and its cancel one more), not a stream of its own — etcd sets up a stream with
//! goroutines and buffers, which cost more than the watch itself.
//!
//! `Hub::watch` registers a watch (a route) and returns a [`Watch`], which receives that route's
//! events and cancels it when dropped. A task reads the stream and routes responses by watch id.
//! A route keeps the revision it has reached (the one after the last event it was sent, or the
//! revision it started from), and is only ever set up again from there:
//!
//! - **etcd ends a watch its owner still holds** (a compaction passed it while it lagged, a
//!   server-side cancel, whatever reason etcd gives): the route is set up again under a **fresh
//!   watch id**, after a cancel of the old id (etcd 3.4 keeps a compacted watch's id until the
//!   client cancels it, and refuses a create that reuses it), from the revision it had reached
//!   (or the compaction's revision, when history before that is gone); once etcd says it is in
//!   place its owner gets [`Seen::Reset`] and reads what it may have missed.
//! - **etcd refuses a create**: counted, logged, and tried again under a fresh id after a growing
//!   pause (a watch's first create is refused to its caller instead). etcd answers the creates of
//!   one stream in the order it got them, a refused one under watch id -1: the hub keeps the
//!   creates it sent in that order, so a refusal is matched to its route, never dropped.
//! - **The stream breaks, or its member is marked down**: a new stream on a member that answers
//!   registers every route again, each from its revision, and each owner gets [`Seen::Reset`].
//!
//! A watch is only ever ended by its owner dropping it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{
    Event, EventType, WatchOptions, WatchRequestSender, WatchResponse, WatchResponseStream,
};
use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::timeout;
use tokio::time::{Instant, sleep};

use super::endpoints::Endpoints;
use super::error::{EtcdError, EtcdErrorKind, Fail};

/// A watch event's kind as etcd sent it, `None` for a kind this broker does not know (a newer
/// server's, or a damaged response): `Event::event_type` would panic on one.
pub(crate) fn event_kind(event: &Event) -> Option<EventType> {
    match event.0.r#type {
        0 => Some(EventType::Put),
        1 => Some(EventType::Delete),
        _ => None,
    }
}

/// What a [`Watch`] receives.
#[derive(Debug)]
pub(super) enum Seen {
    /// Events on the watched key or range.
    Events(Vec<Event>),
    /// The watch was set up again (a new stream, or after etcd ended it): look again.
    Reset,
}

/// One registered watch.
struct Route {
    key: String,
    /// Its options, without a watch id or a start revision (both set per create).
    options: WatchOptions,
    to: mpsc::UnboundedSender<Seen>,
    /// Its watch id on the current stream, once a create was sent there: a fresh one per
    /// create, never reused.
    id: Option<i64>,
    /// etcd has said the watch under `id` is in place.
    in_place: bool,
    /// The revision to set it up from: the one after the last event it was sent, or the one
    /// it was asked to start from (0, "from now", until its first create is answered).
    next: i64,
    /// The caller of [`Hub::watch`], told how the first create went (refused: it gets the
    /// error, and drops the watch).
    first: Option<oneshot::Sender<Result<(), String>>>,
    /// Set up again (not its first create): its owner gets a reset once it is in place.
    again: bool,
    /// Times in a row etcd ended or refused it (set up again after a growing pause).
    strikes: u32,
}

/// The routes, and which watch ids of the current stream are theirs.
struct Table {
    routes: HashMap<u64, Route>,
    /// The stream the ids below belong to.
    generation: u64,
    /// Watch ids of the current stream, to their routes.
    ids: HashMap<i64, u64>,
    /// Creates sent on the current stream that etcd has not answered, in the order sent.
    pending: VecDeque<i64>,
}

/// The stream in use: where requests go, and which generation it is.
struct Conn {
    generation: u64,
    sender: WatchRequestSender,
}

/// A broker's shared watch stream.
pub(super) struct Hub {
    endpoints: Arc<Endpoints>,
    /// Watched by the connection itself, so that a stream can be opened before any waiter
    /// watches (etcd-client opens a stream with its first watch).
    anchor: String,
    table: Mutex<Table>,
    conn: tokio::sync::Mutex<Option<Conn>>,
    next_route: AtomicU64,
    next_id: AtomicI64,
    generation: AtomicU64,
    retry_for: Duration,
    /// Woken whenever etcd answers a create.
    answered: Notify,
    /// Watches etcd ended that the hub set up again (see `EtcdBroker` test support).
    pub(super) recreated: AtomicU64,
    /// Watch events routed to their watches (see `EtcdBroker` test support).
    pub(super) events_routed: AtomicU64,
    /// Cancellations etcd sent for a watch nobody dropped, and a wake on each.
    pub(super) cancels_seen: AtomicU64,
    cancel_seen: Notify,
    /// Creates etcd refused (see `EtcdBroker` test support).
    pub(super) refusals: AtomicU64,
    /// Test support: a watch etcd ended is set up again under its old id, without a cancel.
    #[cfg(feature = "fault-injection")]
    pub(super) reuse_ids: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("watches", &self.table.lock().routes.len())
            .finish_non_exhaustive()
    }
}

/// The anchor's watch id (the routes' ids start above it).
const ANCHOR: i64 = 1;

/// A watch on the hub's stream; cancelled when dropped.
pub(super) struct Watch {
    hub: Weak<Hub>,
    route: u64,
    pub(super) seen: mpsc::UnboundedReceiver<Seen>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(hub) = self.hub.upgrade() else {
            return;
        };
        let cancel = {
            let mut t = hub.table.lock();
            let generation = t.generation;
            let id = t.routes.remove(&self.route).and_then(|r| r.id);
            if let Some(id) = id {
                t.ids.remove(&id);
            }
            id.map(|id| (generation, id))
        };
        if let Some((generation, id)) = cancel
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                let mut conn = hub.conn.lock().await;
                if let Some(c) = conn.as_mut().filter(|c| c.generation == generation) {
                    let _ = c.sender.cancel(id).await;
                }
            });
        }
    }
}

impl Hub {
    pub(super) fn new(endpoints: Arc<Endpoints>, anchor: String, retry_for: Duration) -> Arc<Self> {
        Arc::new(Self {
            endpoints,
            anchor,
            table: Mutex::new(Table {
                routes: HashMap::new(),
                generation: 0,
                ids: HashMap::new(),
                pending: VecDeque::new(),
            }),
            conn: tokio::sync::Mutex::new(None),
            next_route: AtomicU64::new(0),
            next_id: AtomicI64::new(ANCHOR + 1),
            generation: AtomicU64::new(0),
            retry_for,
            answered: Notify::new(),
            recreated: AtomicU64::new(0),
            events_routed: AtomicU64::new(0),
            cancels_seen: AtomicU64::new(0),
            cancel_seen: Notify::new(),
            refusals: AtomicU64::new(0),
            #[cfg(feature = "fault-injection")]
            reuse_ids: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Watches `key` with `options` (no watch id, no start revision: the hub sets both), from
    /// revision `from` (`None`: from now). The watch is in place when this returns (etcd has
    /// said so). `Err` when no member answers within the retry bound, or when etcd refuses the
    /// watch.
    pub(super) async fn watch(
        self: &Arc<Self>,
        key: String,
        options: WatchOptions,
        from: Option<i64>,
    ) -> Result<Watch, Fail> {
        let route = self.next_route.fetch_add(1, Ordering::Relaxed);
        let (to, seen) = mpsc::unbounded_channel();
        let (first, answer) = oneshot::channel();
        self.table.lock().routes.insert(
            route,
            Route {
                key,
                options,
                to,
                id: None,
                in_place: false,
                next: from.unwrap_or(0),
                first: Some(first),
                again: false,
                strikes: 0,
            },
        );
        // Dropped on any error below: the route goes with it.
        let watch = Watch {
            hub: Arc::downgrade(self),
            route,
            seen,
        };
        {
            let mut conn = self.conn.lock().await;
            let sent = match conn.as_mut() {
                Some(c) => {
                    self.send_create(c.generation, &mut c.sender, route, None)
                        .await
                }
                None => false,
            };
            if !sent {
                // No stream, or a broken one: a new one registers every route, this one too.
                *conn = Some(self.connect().await?);
            }
        }
        match timeout(self.retry_for, answer).await {
            Ok(Ok(Ok(()))) => Ok(watch),
            Ok(Ok(Err(reason))) => Err(Fail::Fatal(EtcdError::new(
                if reason.contains("permission denied") {
                    EtcdErrorKind::Auth
                } else {
                    EtcdErrorKind::InvalidResponse
                },
                format!("etcd refused a watch: {reason}"),
            ))),
            // Its route went (the broker is going).
            Ok(Err(_)) => Err(Fail::Ambiguous("a watch was dropped while set up".into())),
            Err(_) => Err(Fail::Ambiguous(format!(
                "a watch was not set up within {:?}",
                self.retry_for
            ))),
        }
    }

    /// Sends the create of `route` on the stream `generation` (`sender`, under the `conn`
    /// lock, so that creates are recorded in the order they are sent), under a fresh watch id,
    /// from the route's revision. `false` when the stream is broken (or the route gone).
    async fn send_create(
        &self,
        generation: u64,
        sender: &mut WatchRequestSender,
        route: u64,
        reuse: Option<i64>,
    ) -> bool {
        let id = reuse.unwrap_or_else(|| self.next_id.fetch_add(1, Ordering::Relaxed));
        let request = {
            let mut t = self.table.lock();
            if t.generation != generation {
                return false;
            }
            let Some(r) = t.routes.get_mut(&route) else {
                return true; // dropped meanwhile: nothing to set up
            };
            r.id = Some(id);
            r.in_place = false;
            let request = (
                r.key.clone(),
                r.options
                    .clone()
                    .with_watch_id(id)
                    .with_start_revision(r.next),
            );
            t.ids.insert(id, route);
            t.pending.push_back(id);
            request
        };
        sender.watch(request.0, Some(request.1)).await.is_ok()
    }

    /// Opens a stream on a member that answers, registers every route on it (each from its
    /// revision) and waits until etcd has answered every create; starts the task that reads it.
    /// Each route set up again tells its owner to look again once it is in place.
    fn connect(self: &Arc<Self>) -> BoxFuture<'static, Result<Conn, Fail>> {
        // Boxed: the reader task it starts calls it again when the stream breaks.
        Box::pin(Arc::clone(self).connect_now())
    }

    async fn connect_now(self: Arc<Self>) -> Result<Conn, Fail> {
        let anchor = self.anchor.clone();
        let (member, stream) = self
            .endpoints
            .call_on("watch", Instant::now() + self.retry_for, |mut c| {
                let anchor = anchor.clone();
                async move {
                    c.watch(anchor, Some(WatchOptions::new().with_watch_id(ANCHOR)))
                        .await
                }
            })
            .await?;
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let (mut sender, responses) = stream.split();
        let routes: Vec<u64> = {
            let mut t = self.table.lock();
            t.generation = generation;
            t.ids.clear();
            t.pending.clear();
            // etcd-client sent the anchor's create with the stream.
            t.pending.push_back(ANCHOR);
            for r in t.routes.values_mut() {
                r.id = None;
                r.in_place = false;
                r.again = r.first.is_none();
            }
            t.routes.keys().copied().collect()
        };
        tokio::spawn(read(Arc::downgrade(&self), generation, member, responses));
        for route in routes {
            if !self.send_create(generation, &mut sender, route, None).await {
                return Err(Fail::Ambiguous(
                    "the watch stream broke while set up".into(),
                ));
            }
        }
        let answered = async {
            loop {
                let woken = self.answered.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                {
                    let t = self.table.lock();
                    if t.generation != generation || t.pending.is_empty() {
                        return;
                    }
                }
                woken.await;
            }
        };
        if timeout(self.retry_for, answered).await.is_err() {
            return Err(Fail::Ambiguous("watches were not set up in time".into()));
        }
        Ok(Conn { generation, sender })
    }

    /// Takes in one response of stream `generation`. Returns a route to set up again (its
    /// old watch id to cancel first, if etcd keeps it) and after which pause.
    fn take(&self, generation: u64, resp: &WatchResponse) -> Option<Recreate> {
        let mut t = self.table.lock();
        if t.generation != generation {
            return None;
        }
        let id = resp.watch_id();
        if resp.created() {
            // etcd answers creates in the order it got them (a refused one under id -1).
            let sent = match t.pending.iter().position(|p| *p == id) {
                Some(at) => t.pending.remove(at),
                None => t.pending.pop_front(),
            };
            self.answered.notify_waiters();
            let sent = sent.filter(|s| *s != ANCHOR)?;
            let route_id = *t.ids.get(&sent)?;
            let refused = resp.canceled();
            if refused {
                t.ids.remove(&sent);
            }
            let r = t.routes.get_mut(&route_id)?;
            if r.id != Some(sent) {
                return None; // a later create replaced it
            }
            if refused {
                self.refusals.fetch_add(1, Ordering::Relaxed);
                r.id = None;
                let reason = resp.cancel_reason().to_owned();
                tracing::warn!(watch = r.key, reason, "etcd refused a watch");
                if let Some(first) = r.first.take() {
                    // Its caller gets the refusal and drops the watch.
                    let _ = first.send(Err(reason));
                    return None;
                }
                r.strikes += 1;
                return Some(Recreate {
                    route: route_id,
                    cancel: None,
                    pause: recreate_pause(r.strikes),
                });
            }
            r.in_place = true;
            if r.next == 0 {
                // From now: the watch covers every revision after the one it was created at.
                r.next = resp.header().map_or(0, |h| h.revision() + 1);
            }
            if let Some(first) = r.first.take() {
                let _ = first.send(Ok(()));
            }
            if std::mem::take(&mut r.again) {
                self.recreated.fetch_add(1, Ordering::Relaxed);
                let _ = r.to.send(Seen::Reset);
            }
            return None;
        }
        if resp.canceled() {
            // etcd ended a watch: one its owner still holds (a compaction passed it while it
            // lagged, a server-side cancel), or one whose owner dropped it (not in `ids` any
            // more: nothing to do).
            let route_id = t.ids.remove(&id)?;
            let r = t.routes.get_mut(&route_id)?;
            if r.id != Some(id) {
                return None;
            }
            r.id = None;
            r.in_place = false;
            // History before the compaction is gone: from there on (the owner reads what came
            // before), else from where it was.
            r.next = r.next.max(resp.compact_revision());
            r.strikes += 1;
            self.cancels_seen.fetch_add(1, Ordering::Relaxed);
            self.cancel_seen.notify_waiters();
            tracing::debug!(
                watch = r.key,
                reason = resp.cancel_reason(),
                compact_revision = resp.compact_revision(),
                from = r.next,
                "etcd cancelled a watch; it is set up again under a new id"
            );
            return Some(Recreate {
                route: route_id,
                cancel: Some(id),
                pause: recreate_pause(r.strikes),
            });
        }
        if let Some(last) = resp.events().last() {
            let r = t
                .ids
                .get(&id)
                .copied()
                .and_then(|route| t.routes.get_mut(&route))?;
            r.strikes = 0;
            if let Some(kv) = last.kv() {
                r.next = r.next.max(kv.mod_revision() + 1);
            }
            self.events_routed
                .fetch_add(resp.events().len() as u64, Ordering::Relaxed);
            let _ = r.to.send(Seen::Events(resp.events().to_vec()));
        }
        None
    }
}

/// A route to set up again on the stream it was on.
struct Recreate {
    route: u64,
    /// The watch id etcd ended, which it keeps until the client cancels it.
    cancel: Option<i64>,
    pause: Duration,
}

/// Routes the stream's responses, until it breaks or its member goes down; then opens a new
/// one (if any watch is left and no newer stream replaced it).
async fn read(hub: Weak<Hub>, generation: u64, member: usize, mut responses: WatchResponseStream) {
    let Some(endpoints) = hub.upgrade().map(|h| Arc::clone(&h.endpoints)) else {
        return;
    };
    let mut members = endpoints.subscribe();
    loop {
        tokio::select! {
            msg = responses.message() => match msg {
                Ok(Some(resp)) => {
                    let Some(me) = hub.upgrade() else { return };
                    if let Some(again) = me.take(generation, &resp) {
                        tokio::spawn(recreate(Arc::downgrade(&me), generation, again));
                    }
                }
                _ => break,
            },
            _ = members.changed() => {
                if endpoints.is_down(member) {
                    break;
                }
            }
        }
    }
    // Broken: a new stream, unless the broker is gone, nobody watches, or a newer stream
    // already replaced this one.
    let mut backoff = Duration::from_millis(20);
    loop {
        let Some(hub) = hub.upgrade() else { return };
        let mut conn = hub.conn.lock().await;
        if conn.as_ref().is_some_and(|c| c.generation != generation) {
            return;
        }
        *conn = None;
        if hub.table.lock().routes.is_empty() {
            return;
        }
        match hub.connect().await {
            Ok(new) => {
                *conn = Some(new);
                return;
            }
            Err(_) => {
                drop(conn);
                drop(hub);
                sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// The pause before a watch that etcd ended or refused `times` times in a row is set up again:
/// none the first time, then growing, so that a watch etcd refuses outright does not spin.
fn recreate_pause(times: u32) -> Duration {
    if times <= 1 {
        Duration::ZERO
    } else {
        (Duration::from_millis(20) * 2u32.saturating_pow(times - 2)).min(Duration::from_secs(1))
    }
}

/// Sets a route up again on stream `generation` after the pause: cancels the watch id etcd
/// ended (it keeps a compacted watch's id until the client cancels it), then creates it under a
/// fresh id, from the revision it had reached; its owner gets a reset once etcd says it is in
/// place. Nothing to do if the owner dropped it or the stream was replaced (the new stream set
/// every route up again, with a reset).
async fn recreate(hub: Weak<Hub>, generation: u64, again: Recreate) {
    if !again.pause.is_zero() {
        sleep(again.pause).await;
    }
    let Some(hub) = hub.upgrade() else { return };
    let mut conn = hub.conn.lock().await;
    let Some(c) = conn.as_mut().filter(|c| c.generation == generation) else {
        return;
    };
    // Test support: the old id reused without a cancel, as this hub once did.
    #[cfg(feature = "fault-injection")]
    let reuse = again
        .cancel
        .filter(|_| hub.reuse_ids.load(std::sync::atomic::Ordering::Relaxed));
    #[cfg(not(feature = "fault-injection"))]
    let reuse = None;
    if let Some(old) = again.cancel.filter(|_| reuse.is_none())
        && c.sender.cancel(old).await.is_err()
    {
        return; // the stream broke: its reader sets every route up again
    }
    {
        let mut t = hub.table.lock();
        match t.routes.get_mut(&again.route) {
            Some(r) if r.id.is_none() => r.again = true,
            _ => return, // dropped, or set up again by a new stream
        }
    }
    // A broken stream's reader sets every route up again.
    let _ = hub
        .send_create(generation, &mut c.sender, again.route, reuse)
        .await;
}

#[cfg(feature = "fault-injection")]
impl Hub {
    /// How many watches etcd has said are in place.
    pub(super) fn watch_count(&self) -> usize {
        self.table
            .lock()
            .routes
            .values()
            .filter(|r| r.in_place)
            .count()
    }

    /// Asks etcd to cancel every watch of the current stream without dropping them (what etcd
    /// does on its own to a watch that a compaction passed); returns once etcd has answered
    /// each cancel, or after the retry bound. How many watches it cancelled.
    pub(super) async fn cancel_on_server(&self) -> usize {
        let before = self.cancels_seen.load(Ordering::Relaxed);
        let mut conn = self.conn.lock().await;
        let Some(c) = conn.as_mut() else { return 0 };
        let ids: Vec<i64> = {
            let t = self.table.lock();
            if t.generation != c.generation {
                return 0;
            }
            t.routes.values().filter_map(|r| r.id).collect()
        };
        for id in &ids {
            let _ = c.sender.cancel(*id).await;
        }
        drop(conn);
        let want = before + ids.len() as u64;
        let _ = timeout(self.retry_for, async {
            loop {
                let seen = self.cancel_seen.notified();
                tokio::pin!(seen);
                seen.as_mut().enable();
                if self.cancels_seen.load(Ordering::Relaxed) >= want {
                    return;
                }
                seen.await;
            }
        })
        .await;
        ids.len()
    }
}
