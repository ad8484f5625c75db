//! Endpoint health: one etcd client per member, calls sent to a member that answers, and a
//! member that fails skipped until a probe finds it healthy again.
//!
//! etcd-client's own balancer keeps dialling a dead member (a refused connection and a backoff
//! per call). Here every member has its own client; a call that gets no answer (or "no leader")
//! marks its member down and moves at once to the next healthy one, without a backoff. A down
//! member gets no calls; a background probe (a serializable read that requires a leader) tries
//! it with a doubling interval and puts it back when it answers. Only when every member is
//! down does a call back off, on the member that failed longest ago.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use parking_lot::Mutex;
use tokio::sync::{OnceCell, watch};
use tokio::time::{Instant, sleep, timeout};

use super::error::{Fail, classify};

/// First probe of a member marked down; doubled up to [`PROBE_MAX`].
const PROBE_FIRST: Duration = Duration::from_millis(100);
const PROBE_MAX: Duration = Duration::from_secs(2);
/// Backoff when every member is down.
const BACKOFF_FIRST: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

struct Member {
    url: String,
    /// Made on first use: with auth, making a client is itself a call.
    client: OnceCell<Client>,
    /// `Some(since)` while the member is skipped.
    down: Mutex<Option<Instant>>,
    probing: Mutex<bool>,
}

/// The cluster's members and their health.
pub(super) struct Endpoints {
    members: Vec<Member>,
    options: ConnectOptions,
    connect_timeout: Duration,
    rpc_timeout: Duration,
    /// The member calls go to while it answers (sticky, so that streams and calls share one
    /// connection).
    preferred: AtomicUsize,
    /// Bumped whenever a member goes down or comes back: a stream on a member that went down
    /// moves.
    changes: watch::Sender<u64>,
    /// A key the probe reads (the pool's capacity record).
    probe_key: String,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<&str> = self.members.iter().map(|m| m.url.as_str()).collect();
        f.debug_struct("Endpoints").field("members", &urls).finish()
    }
}

impl Endpoints {
    pub(super) fn new(
        urls: &[String],
        options: ConnectOptions,
        connect_timeout: Duration,
        rpc_timeout: Duration,
        probe_key: String,
        first: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            members: urls
                .iter()
                .map(|url| Member {
                    url: url.clone(),
                    client: OnceCell::new(),
                    down: Mutex::new(None),
                    probing: Mutex::new(false),
                })
                .collect(),
            options,
            connect_timeout,
            rpc_timeout,
            preferred: AtomicUsize::new(first % urls.len().max(1)),
            changes: watch::Sender::new(0),
            probe_key,
        })
    }

    /// Whether member `i` is skipped now.
    pub(super) fn is_down(&self, i: usize) -> bool {
        self.members[i].down.lock().is_some()
    }

    /// Wakes when a member goes down or comes back.
    pub(super) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The member to use now: the preferred one if healthy, else the next healthy one, else
    /// (every member down) the one that failed longest ago. `true` when it is healthy.
    fn pick(&self) -> (usize, bool) {
        let n = self.members.len();
        let first = self.preferred.load(Ordering::Relaxed);
        if let Some(i) = (0..n).map(|k| (first + k) % n).find(|i| !self.is_down(*i)) {
            return (i, true);
        }
        let oldest = (0..n)
            .min_by_key(|i| *self.members[*i].down.lock())
            .unwrap_or(0);
        (oldest, false)
    }

    fn healthy_count(&self) -> usize {
        (0..self.members.len())
            .filter(|i| !self.is_down(*i))
            .count()
    }

    async fn client(&self, i: usize) -> Result<Client, Fail> {
        let member = &self.members[i];
        member
            .client
            .get_or_try_init(|| async {
                match timeout(
                    self.connect_timeout,
                    Client::connect([member.url.as_str()], Some(self.options.clone())),
                )
                .await
                {
                    Ok(Ok(client)) => Ok(client),
                    Ok(Err(err)) => Err(classify(err)),
                    Err(_) => Err(Fail::Ambiguous(format!(
                        "connect to {}: no answer within {:?}",
                        member.url, self.connect_timeout
                    ))),
                }
            })
            .await
            .cloned()
    }

    /// Marks member `i` down (skipped) and starts its probe.
    pub(super) fn mark_down(self: &Arc<Self>, i: usize, why: &str) {
        let member = &self.members[i];
        {
            let mut down = member.down.lock();
            if down.is_some() {
                return;
            }
            *down = Some(Instant::now());
        }
        tracing::debug!(endpoint = %member.url, why, "etcd member skipped until healthy");
        self.changes.send_modify(|n| *n += 1);
        let start = {
            let mut probing = member.probing.lock();
            !std::mem::replace(&mut *probing, true)
        };
        if start && let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(probe(Arc::downgrade(self), i));
        } else if start {
            *member.probing.lock() = false;
        }
    }

    fn mark_up(&self, i: usize) {
        let member = &self.members[i];
        if member.down.lock().take().is_some() {
            tracing::debug!(endpoint = %member.url, "etcd member healthy again");
            self.changes.send_modify(|n| *n += 1);
        }
    }

    /// One etcd call, bounded by the call timeout, retried while its answer is lost or etcd is
    /// unavailable, until `deadline`: at once on another healthy member, with a backoff when
    /// none is left. Returns which member answered. Every call passed here must be idempotent.
    pub(super) async fn call_on<T, F, Fut>(
        self: &Arc<Self>,
        what: &str,
        deadline: Instant,
        mut f: F,
    ) -> Result<(usize, T), Fail>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut backoff = BACKOFF_FIRST;
        let mut tried = 0;
        loop {
            let (i, healthy) = self.pick();
            let outcome = match self.client(i).await {
                Ok(client) => match timeout(self.rpc_timeout, f(client)).await {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(err)) => Err(classify(err)),
                    Err(_) => Err(Fail::Ambiguous(format!(
                        "no answer within {:?}",
                        self.rpc_timeout
                    ))),
                },
                Err(fail) => Err(fail),
            };
            let last = match outcome {
                Ok(v) => {
                    self.mark_up(i);
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok((i, v));
                }
                Err(Fail::Ambiguous(m)) => m,
                Err(definite) => return Err(definite),
            };
            self.mark_down(i, &last);
            tried += 1;
            if healthy && self.healthy_count() > 0 && tried < self.members.len() {
                tracing::debug!(what, error = %last, "etcd call moved to another member");
                continue;
            }
            tried = 0;
            if Instant::now() + backoff >= deadline {
                return Err(Fail::Ambiguous(last));
            }
            tracing::debug!(what, error = %last, "etcd call retried");
            sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// [`call_on`](Self::call_on) without saying which member answered.
    pub(super) async fn call<T, F, Fut>(
        self: &Arc<Self>,
        what: &str,
        deadline: Instant,
        f: F,
    ) -> Result<T, Fail>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_on(what, deadline, f).await.map(|(_, v)| v)
    }
}

/// Tries a member marked down until it answers a read that requires a leader.
async fn probe(endpoints: Weak<Endpoints>, i: usize) {
    let mut delay = PROBE_FIRST;
    loop {
        sleep(delay).await;
        let Some(me) = endpoints.upgrade() else {
            return;
        };
        {
            // Checked under the `probing` lock: a `mark_down` that comes after this sees
            // `probing == false` and starts a new probe.
            let mut probing = me.members[i].probing.lock();
            if !me.is_down(i) {
                *probing = false;
                return;
            }
        }
        let key = me.probe_key.clone();
        let answered = match me.client(i).await {
            Ok(mut c) => matches!(
                timeout(
                    me.rpc_timeout,
                    c.get(key, Some(GetOptions::new().with_serializable()))
                )
                .await,
                Ok(Ok(_))
            ),
            Err(_) => false,
        };
        if answered {
            *me.members[i].probing.lock() = false;
            me.mark_up(i);
            return;
        }
        delay = (delay * 2).min(PROBE_MAX);
    }
}
