//! Test support: a fault-injecting broker that keeps its own, independent record of what it
//! granted and released.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use leasehold::{AcquireRequest, BrokerError, LocalBroker, SlotBroker, SlotToken, Stats};
use parking_lot::Mutex;
use tokio::sync::Notify;

/// What one broker call does.
#[derive(Clone)]
pub enum Plan {
    Ok,
    /// The broker answers with an error (for a release: the slot *is* freed underneath, as when a
    /// remote applied the release but its answer failed).
    Fail,
    /// Never answers; the slot is freed when the call is dropped (the supervisor's timeout), as a
    /// distributed broker's TTL would.
    Hang,
    /// Answers only after the gate is notified, then behaves as `Ok`.
    Gate(Arc<Notify>),
    /// Answers only after the gate is notified, then behaves as `Fail`.
    GateThenFail(Arc<Notify>),
    /// Panics on its first poll, before any await (for a release: the slot is freed
    /// underneath, as a remote that applied it).
    Panic,
    /// Awaits once (so the supervisor finishes the call in a task of its own), then panics (for
    /// a release: the slot is freed underneath first).
    PanicAfterAwait,
}

type Planner = Box<dyn Fn(u64) -> Plan + Send + Sync>;

pub struct Inner {
    local: LocalBroker,
    capacity: u32,
    acquire_plan: Mutex<Planner>,
    release_plan: Mutex<Planner>,
    close_plan: Mutex<Plan>,
    close_calls: AtomicU64,
    acquire_calls: AtomicU64,
    release_calls: AtomicU64,
    releases_per_token: Mutex<HashMap<SlotToken, u32>>,
    held: AtomicUsize,
    max_held: AtomicUsize,
    /// Every release notifies this (tests wait for a release without sleeping).
    pub released: Notify,
    /// Each broker acquire call stores a permit here when it starts.
    pub acquire_entered: Notify,
    /// Each broker release call stores a permit here when it starts.
    pub release_entered: Notify,
}

/// A cloneable handle: the test keeps one, the supervisor owns another.
#[derive(Clone)]
pub struct TestBroker(pub Arc<Inner>);

impl TestBroker {
    pub fn new(slots: u32) -> Self {
        Self(Arc::new(Inner {
            local: LocalBroker::new(slots),
            capacity: slots,
            acquire_plan: Mutex::new(Box::new(|_| Plan::Ok)),
            release_plan: Mutex::new(Box::new(|_| Plan::Ok)),
            close_plan: Mutex::new(Plan::Ok),
            close_calls: AtomicU64::new(0),
            acquire_calls: AtomicU64::new(0),
            release_calls: AtomicU64::new(0),
            releases_per_token: Mutex::new(HashMap::new()),
            held: AtomicUsize::new(0),
            max_held: AtomicUsize::new(0),
            released: Notify::new(),
            acquire_entered: Notify::new(),
            release_entered: Notify::new(),
        }))
    }

    /// `plan(n)` decides the n-th acquire call (counting from 0).
    pub fn on_acquire(&self, plan: impl Fn(u64) -> Plan + Send + Sync + 'static) -> &Self {
        *self.0.acquire_plan.lock() = Box::new(plan);
        self
    }

    /// `plan(lease_id)` decides the release of that lease.
    /// Answers every release `Ok` and logs it in `log` as `"release"` (to order it against the
    /// pipeline's other events).
    pub fn log_releases(&self, log: &EventLog) -> &Self {
        let log = log.clone();
        self.on_release(move |_| {
            log.push("release");
            Plan::Ok
        })
    }

    pub fn on_release(&self, plan: impl Fn(u64) -> Plan + Send + Sync + 'static) -> &Self {
        *self.0.release_plan.lock() = Box::new(plan);
        self
    }

    /// What the broker's close at shutdown does.
    pub fn on_close(&self, plan: Plan) -> &Self {
        *self.0.close_plan.lock() = plan;
        self
    }

    pub fn close_calls(&self) -> u64 {
        self.0.close_calls.load(Ordering::SeqCst)
    }

    pub fn acquire_calls(&self) -> u64 {
        self.0.acquire_calls.load(Ordering::SeqCst)
    }

    pub fn release_calls(&self) -> u64 {
        self.0.release_calls.load(Ordering::SeqCst)
    }

    /// Broker releases per token; every value must be 1.
    pub fn releases_per_token(&self) -> HashMap<SlotToken, u32> {
        self.0.releases_per_token.lock().clone()
    }

    pub fn held(&self) -> usize {
        self.0.held.load(Ordering::SeqCst)
    }

    pub fn max_held(&self) -> usize {
        self.0.max_held.load(Ordering::SeqCst)
    }

    /// Invariants 1, 4 and 5 of DESIGN.md section 3, checked against this broker's own record and
    /// the supervisor's stats once everything has ended.
    pub fn assert_quiescent(&self, stats: Stats) {
        assert!(
            self.max_held() <= self.0.capacity as usize,
            "capacity exceeded: {}",
            self.max_held()
        );
        for (token, n) in self.releases_per_token() {
            assert_eq!(n, 1, "{token} released {n} times");
        }
        assert_eq!(stats.active, 0, "{stats:?}");
        assert_eq!(stats.waiting, 0, "{stats:?}");
        assert_eq!(
            self.held(),
            stats.quarantined,
            "broker still holds slots that are not quarantined: {stats:?}"
        );
        assert_eq!(
            stats.acquired_total,
            stats.released_total + stats.release_failed_total + stats.quarantined as u64,
            "{stats:?}"
        );
        assert_eq!(
            stats.acquired_total,
            self.release_calls() + stats.quarantined as u64
        );
    }

    fn free(&self, token: SlotToken) {
        futures_free(&self.0.local, token);
        self.0.held.fetch_sub(1, Ordering::SeqCst);
        self.0.released.notify_waiters();
    }
}

fn futures_free(local: &LocalBroker, token: SlotToken) {
    // LocalBroker answers on the first poll.
    let fut = local.release(token);
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(r) => r.expect("test broker freed a token it did not hold"),
        std::task::Poll::Pending => unreachable!("LocalBroker never waits"),
    }
}

use std::future::Future;

/// Frees the slot when dropped: a hung release whose future the supervisor dropped at its
/// timeout is "expired" by the broker, as a TTL would.
struct FreeOnDrop(Option<(TestBroker, SlotToken)>);

impl Drop for FreeOnDrop {
    fn drop(&mut self) {
        if let Some((broker, token)) = self.0.take() {
            broker.free(token);
        }
    }
}

impl SlotBroker for TestBroker {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        let n = self.0.acquire_calls.fetch_add(1, Ordering::SeqCst);
        let plan = (self.0.acquire_plan.lock())(n);
        self.0.acquire_entered.notify_one();
        let fail = || {
            Err(BrokerError::unavailable(format!(
                "injected failure of acquire {n}"
            )))
        };
        match plan {
            Plan::Ok => {}
            Plan::Fail => return fail(),
            Plan::Hang => std::future::pending::<()>().await,
            Plan::Gate(gate) => gate.notified().await,
            Plan::GateThenFail(gate) => {
                gate.notified().await;
                return fail();
            }
            Plan::Panic => panic!("injected panic in acquire {n}"),
            Plan::PanicAfterAwait => {
                tokio::task::yield_now().await;
                panic!("injected panic in acquire {n} after an await")
            }
        }
        let token = self.0.local.acquire(request).await?;
        let held = self.0.held.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.max_held.fetch_max(held, Ordering::SeqCst);
        Ok(token)
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.0.release_calls.fetch_add(1, Ordering::SeqCst);
        *self.0.releases_per_token.lock().entry(token).or_default() += 1;
        let plan = (self.0.release_plan.lock())(token.lease_id());
        self.0.release_entered.notify_one();
        match plan {
            Plan::Ok => {
                self.free(token);
                Ok(())
            }
            Plan::Fail => {
                self.free(token);
                Err(BrokerError::new(format!(
                    "injected failure releasing {token}"
                )))
            }
            Plan::Hang => {
                let _expire = FreeOnDrop(Some((self.clone(), token)));
                std::future::pending().await
            }
            Plan::Gate(gate) => {
                gate.notified().await;
                self.free(token);
                Ok(())
            }
            Plan::GateThenFail(gate) => {
                gate.notified().await;
                self.free(token);
                Err(BrokerError::new(format!(
                    "injected failure releasing {token}"
                )))
            }
            Plan::Panic => {
                self.free(token);
                panic!("injected panic releasing {token}")
            }
            Plan::PanicAfterAwait => {
                tokio::task::yield_now().await;
                self.free(token);
                panic!("injected panic releasing {token} after an await")
            }
        }
    }

    async fn close(&self) -> Result<(), BrokerError> {
        self.0.close_calls.fetch_add(1, Ordering::SeqCst);
        let plan = self.0.close_plan.lock().clone();
        match plan {
            Plan::Ok => Ok(()),
            Plan::Fail => Err(BrokerError::new("injected failure closing")),
            Plan::Hang => std::future::pending().await,
            Plan::Gate(gate) => {
                gate.notified().await;
                Ok(())
            }
            Plan::GateThenFail(gate) => {
                gate.notified().await;
                Err(BrokerError::new("injected failure closing"))
            }
            Plan::Panic => panic!("injected panic closing"),
            Plan::PanicAfterAwait => {
                tokio::task::yield_now().await;
                panic!("injected panic closing after an await")
            }
        }
    }

    fn capacity(&self) -> Option<u32> {
        Some(self.0.capacity)
    }
}

/// A one-shot gate usable from blocking threads: `open` lets every `wait` through.
#[derive(Clone, Default)]
pub struct ThreadGate(Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>);

impl ThreadGate {
    pub fn open(&self) {
        *self.0.0.lock().unwrap() = true;
        self.0.1.notify_all();
    }

    pub fn wait(&self) {
        let mut open = self.0.0.lock().unwrap();
        while !*open {
            open = self.0.1.wait(open).unwrap();
        }
    }
}

/// An ordered log of named events, to assert the order of the release pipeline.
#[derive(Clone, Default)]
pub struct EventLog(Arc<Mutex<Vec<String>>>);

impl EventLog {
    pub fn push(&self, e: impl Into<String>) {
        self.0.lock().push(e.into());
    }

    pub fn events(&self) -> Vec<String> {
        self.0.lock().clone()
    }

    pub fn position(&self, e: &str) -> usize {
        self.events()
            .iter()
            .position(|x| x == e)
            .unwrap_or_else(|| panic!("event {e:?} missing from {:?}", self.events()))
    }
}

/// Alive as far as the kernel knows (Linux `/proc`): the process exists and is not a zombie.
pub fn proc_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            // The state follows the command name, which is in parentheses.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some('Z' | 'X') | None)
        }
    }
}

/// The process exists at all (alive or an unreaped zombie).
pub fn proc_exists(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// An error sink that forwards every orphaned failure to a channel.
pub fn sink_channel() -> (
    impl Fn(&leasehold::OrphanedFailure) + Send + Sync + 'static,
    tokio::sync::mpsc::UnboundedReceiver<leasehold::OrphanedFailure>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = move |failure: &leasehold::OrphanedFailure| {
        let _ = tx.send(failure.clone());
    };
    (sink, rx)
}

/// The first line a child prints, as a number (a test script's `echo $!`, say).
pub async fn first_line(stdout: tokio::process::ChildStdout) -> i32 {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    lines
        .next_line()
        .await
        .unwrap()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// One slot whose broker release always fails, and the receiving end of the error sink.
pub async fn supervisor_whose_releases_fail() -> (
    leasehold::Supervisor,
    tokio::sync::mpsc::UnboundedReceiver<leasehold::OrphanedFailure>,
) {
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let (sink, failures) = sink_channel();
    let sup = leasehold::Supervisor::builder()
        .broker(broker)
        .error_sink(sink)
        .start()
        .await
        .unwrap();
    (sup, failures)
}

/// Polls `cond` between yields to the runtime (the supervisor answers in its own turns). The
/// real-time bound only turns a hang into a failure; it never decides an outcome.
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::task::yield_now().await;
    }
}

/// A supervisor on a one-slot `TestBroker` with `timeout` as its acquire timeout, and the
/// slot held: whoever asks next waits, and times out unless it is released.
pub async fn one_slot_held_under_acquire_timeout(
    timeout: std::time::Duration,
) -> (TestBroker, leasehold::Supervisor, leasehold::Lease) {
    let broker = TestBroker::new(1);
    let sup = leasehold::Supervisor::builder()
        .broker(broker.clone())
        .acquire_timeout(timeout)
        .start()
        .await
        .unwrap();
    let holder = sup.acquire().await.unwrap();
    (broker, sup, holder)
}

/// A supervisor on `broker`, everything else by default.
pub async fn supervise(broker: &TestBroker) -> leasehold::Supervisor {
    leasehold::Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap()
}

/// A supervisor on the in-process pool of `slots`, with a work root of its own.
pub async fn pool(slots: u32) -> (leasehold::Supervisor, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let sup = leasehold::Supervisor::builder()
        .slots(slots)
        .work_root(root.path())
        .start()
        .await
        .unwrap();
    (sup, root)
}

/// Replaces the job's temp dir by a regular file of the same name, so that the supervisor's
/// removal of it as a directory fails and the slot is quarantined. Returns the path.
pub fn clobber_temp_dir(ctx: &leasehold::WorkerContext) -> std::io::Result<std::path::PathBuf> {
    let dir = ctx.temp_dir().to_path_buf();
    std::fs::remove_dir(&dir)?;
    std::fs::write(&dir, b"not a directory")?;
    Ok(dir)
}

/// Runs job `id`, which replaces its temp dir by a regular file: the removal fails, the job
/// ends `LEASE_CLEANUP_UNCONFIRMED` and its slot is quarantined. Returns the file's path (remove
/// it to make the dir removable again).
pub async fn quarantine_by_clobbering(sup: &leasehold::Supervisor, id: &str) -> std::path::PathBuf {
    let (dir_tx, dir_rx) = tokio::sync::oneshot::channel();
    let err = sup
        .run(leasehold::JobSpec::new(id).unwrap(), |ctx| async move {
            let _ = dir_tx.send(clobber_temp_dir(&ctx)?);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    dir_rx.await.unwrap()
}
