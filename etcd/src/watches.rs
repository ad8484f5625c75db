//! One watch stream per broker, shared by all its waiters: a waiter's watch is one message on
//! the stream (and its cancel one more), not a stream of its own — etcd sets up a stream with
//! goroutines and buffers, which cost more than the watch itself.
//!
//! `Hub::watch` registers a watch (from now: etcd serves those at once) under a fresh id and
//! returns a [`Watch`], which receives that id's events and cancels the watch when dropped. A
//! task reads the stream and routes events by watch id. When the stream breaks, or its member
//! is marked down, the hub opens a new one on a member that answers, registers every watch
//! again (from now) and sends each [`Seen::Reset`]: its owner looks again for what happened in
//! between. A watch that etcd cancels on a stream that lives (a slow watcher whose start
//! revision a compaction passed, say) is set up again the same way, on its own: from now, then
//! a [`Seen::Reset`]. A watch is only ever ended by its owner dropping it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Event, WatchOptions, WatchRequestSender, WatchResponseStream};
use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;
use tokio::time::{Instant, sleep};

use super::endpoints::Endpoints;
use super::error::Fail;

/// What a [`Watch`] receives.
#[derive(Debug)]
pub(super) enum Seen {
    /// Events on the watched key or range.
    Events(Vec<Event>),
    /// The watch was set up again (a new stream) or cancelled by etcd: look again.
    Reset,
}

/// One registered watch.
struct Route {
    key: String,
    options: WatchOptions,
    to: mpsc::UnboundedSender<Seen>,
    /// Told when etcd says the watch is in place on the current stream.
    created: Option<oneshot::Sender<()>>,
    /// Times in a row etcd cancelled it (set up again after a growing pause).
    cancelled: u32,
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
    routes: Mutex<HashMap<i64, Route>>,
    conn: tokio::sync::Mutex<Option<Conn>>,
    next_id: AtomicI64,
    generation: AtomicU64,
    retry_for: Duration,
    /// Watches etcd cancelled and the hub set up again (see `EtcdBroker` test support).
    pub(super) recreated: AtomicU64,
    /// Watch events routed to their watches (see `EtcdBroker` test support).
    pub(super) events_routed: AtomicU64,
    /// Cancellations etcd sent for a watch nobody dropped, and a wake on each.
    pub(super) cancels_seen: AtomicU64,
    cancel_seen: tokio::sync::Notify,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("watches", &self.routes.lock().len())
            .finish_non_exhaustive()
    }
}

/// The anchor's watch id (the routes' ids start above it).
const ANCHOR: i64 = 1;

/// A watch on the hub's stream; cancelled when dropped.
pub(super) struct Watch {
    hub: Weak<Hub>,
    id: i64,
    pub(super) seen: mpsc::UnboundedReceiver<Seen>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            hub.routes.lock().remove(&self.id);
            let id = self.id;
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let mut conn = hub.conn.lock().await;
                    if let Some(c) = conn.as_mut() {
                        let _ = c.sender.cancel(id).await;
                    }
                });
            }
        }
    }
}

impl Hub {
    pub(super) fn new(endpoints: Arc<Endpoints>, anchor: String, retry_for: Duration) -> Arc<Self> {
        Arc::new(Self {
            endpoints,
            anchor,
            routes: Mutex::new(HashMap::new()),
            conn: tokio::sync::Mutex::new(None),
            next_id: AtomicI64::new(ANCHOR + 1),
            generation: AtomicU64::new(0),
            retry_for,
            recreated: AtomicU64::new(0),
            events_routed: AtomicU64::new(0),
            cancels_seen: AtomicU64::new(0),
            cancel_seen: tokio::sync::Notify::new(),
        })
    }

    /// Watches `key` with `options` (whose id is set here: a fresh one; from its start
    /// revision, or from now; set up again later, always from now). The watch is in place when this returns (etcd has said so). `Err` only when no
    /// member answers within the retry bound.
    pub(super) async fn watch(
        self: &Arc<Self>,
        key: String,
        options: WatchOptions,
    ) -> Result<Watch, Fail> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (to, seen) = mpsc::unbounded_channel();
        let (created, in_place) = oneshot::channel();
        self.routes.lock().insert(
            id,
            Route {
                key: key.clone(),
                // Set up again from now (a reset tells the owner to look), whatever revision
                // the first request started from: it may be compacted away by then.
                options: options.clone().with_start_revision(0),
                to,
                created: Some(created),
                cancelled: 0,
            },
        );
        let watch = Watch {
            hub: Arc::downgrade(self),
            id,
            seen,
        };
        {
            let mut conn = self.conn.lock().await;
            let sent = match conn.as_mut() {
                Some(c) => c
                    .sender
                    .watch(key, Some(options.with_watch_id(id)))
                    .await
                    .is_ok(),
                None => false,
            };
            if !sent {
                // No stream, or a broken one: a new one registers every route, this one too.
                *conn = Some(self.connect().await?);
                return Ok(watch);
            }
        }
        match timeout(self.retry_for, in_place).await {
            Ok(Ok(())) => Ok(watch),
            // The stream broke before etcd answered: the new one registered this route (and
            // sent it a `Reset`), or will.
            Ok(Err(_)) => Ok(watch),
            Err(_) => Err(Fail::Ambiguous(format!(
                "a watch was not set up within {:?}",
                self.retry_for
            ))),
        }
    }

    /// Opens a stream on a member that answers, registers every route on it (from now) and,
    /// once etcd has set them all up, tells each to look again; starts the task that reads it.
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
        tokio::spawn(read(Arc::downgrade(&self), generation, member, responses));
        let mut acks = Vec::new();
        let routes: Vec<(i64, String, WatchOptions)> = {
            let mut routes = self.routes.lock();
            routes
                .iter_mut()
                .map(|(id, r)| {
                    let (created, in_place) = oneshot::channel();
                    r.created = Some(created);
                    acks.push(in_place);
                    (*id, r.key.clone(), r.options.clone())
                })
                .collect()
        };
        for (id, key, options) in routes {
            sender
                .watch(key, Some(options.with_watch_id(id)))
                .await
                .map_err(|e| Fail::Ambiguous(format!("watch: {e}")))?;
        }
        let all = futures_util::future::join_all(acks);
        if timeout(self.retry_for, all).await.is_err() {
            return Err(Fail::Ambiguous("watches were not set up in time".into()));
        }
        for route in self.routes.lock().values() {
            let _ = route.to.send(Seen::Reset);
        }
        Ok(Conn { generation, sender })
    }
}

/// Routes the stream's events to their watches, until it breaks or its member goes down; then
/// opens a new one (if any watch is left and no newer stream replaced it).
async fn read(hub: Weak<Hub>, generation: u64, member: usize, mut responses: WatchResponseStream) {
    let Some(endpoints) = hub.upgrade().map(|h| Arc::clone(&h.endpoints)) else {
        return;
    };
    let mut members = endpoints.subscribe();
    loop {
        tokio::select! {
            msg = responses.message() => match msg {
                Ok(Some(resp)) => {
                    let Some(hub) = hub.upgrade() else { return };
                    let mut routes = hub.routes.lock();
                    if let Some(route) = routes.get_mut(&resp.watch_id()) {
                        if resp.created()
                            && let Some(created) = route.created.take()
                        {
                            let _ = created.send(());
                        }
                        if resp.canceled() {
                            // Its owner still holds it: etcd ended it (compacted past it, a
                            // slow watcher, ...). Set up again from now, then a reset.
                            route.cancelled += 1;
                            let pause = recreate_pause(route.cancelled);
                            hub.cancels_seen.fetch_add(1, Ordering::Relaxed);
                            hub.cancel_seen.notify_waiters();
                            tracing::debug!(
                                watch = route.key,
                                reason = resp.cancel_reason(),
                                compact_revision = resp.compact_revision(),
                                "etcd cancelled a watch; it is set up again"
                            );
                            tokio::spawn(recreate(
                                Arc::downgrade(&hub),
                                generation,
                                resp.watch_id(),
                                pause,
                            ));
                        } else if !resp.events().is_empty() {
                            route.cancelled = 0;
                            hub.events_routed
                                .fetch_add(resp.events().len() as u64, Ordering::Relaxed);
                            let _ = route.to.send(Seen::Events(resp.events().to_vec()));
                        }
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
        if hub.routes.lock().is_empty() {
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

/// The pause before a watch that etcd cancelled `times` times in a row is set up again: none
/// the first time, then growing, so that a watch etcd refuses outright does not spin.
fn recreate_pause(times: u32) -> Duration {
    if times <= 1 {
        Duration::ZERO
    } else {
        (Duration::from_millis(20) * 2u32.saturating_pow(times - 2)).min(Duration::from_secs(1))
    }
}

/// Sets watch `id` up again on stream `generation`, from now, after `pause`; once etcd says it
/// is in place, tells its owner to look again. Nothing to do if the owner dropped it or the
/// stream was replaced (the new stream set every watch up again, with a reset).
async fn recreate(hub: Weak<Hub>, generation: u64, id: i64, pause: Duration) {
    if !pause.is_zero() {
        sleep(pause).await;
    }
    let Some(hub) = hub.upgrade() else { return };
    let in_place = {
        let mut conn = hub.conn.lock().await;
        let Some(c) = conn.as_mut().filter(|c| c.generation == generation) else {
            return;
        };
        let (key, options, in_place) = {
            let mut routes = hub.routes.lock();
            let Some(route) = routes.get_mut(&id) else {
                return;
            };
            let (created, in_place) = oneshot::channel();
            route.created = Some(created);
            (route.key.clone(), route.options.clone(), in_place)
        };
        if c.sender
            .watch(key, Some(options.with_watch_id(id)))
            .await
            .is_err()
        {
            return; // the stream broke: its reader sets every watch up again
        }
        in_place
    };
    // Not in place in time: the stream is failing, and its reader will set it up again.
    if let Ok(Ok(())) = timeout(hub.retry_for, in_place).await {
        hub.recreated.fetch_add(1, Ordering::Relaxed);
        if let Some(route) = hub.routes.lock().get(&id) {
            let _ = route.to.send(Seen::Reset);
        }
    }
}

#[cfg(feature = "fault-injection")]
impl Hub {
    /// How many watches etcd has said are in place.
    pub(super) fn watch_count(&self) -> usize {
        self.routes
            .lock()
            .values()
            .filter(|r| r.created.is_none())
            .count()
    }

    /// Asks etcd to cancel every watch of the current stream without dropping them (what etcd
    /// does on its own to a watch that a compaction passed); returns once etcd has answered
    /// each cancel, or after the retry bound. How many watches it cancelled.
    pub(super) async fn cancel_on_server(&self) -> usize {
        let before = self.cancels_seen.load(Ordering::Relaxed);
        let ids: Vec<i64> = self.routes.lock().keys().copied().collect();
        {
            let mut conn = self.conn.lock().await;
            let Some(c) = conn.as_mut() else { return 0 };
            for id in &ids {
                let _ = c.sender.cancel(*id).await;
            }
        }
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
