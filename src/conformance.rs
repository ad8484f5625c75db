//! A conformance suite for [`SlotBroker`] implementations (feature `conformance`).
//!
//! Run it against your own broker to check that the supervisor's guarantees hold over it. It
//! drives a real [`Supervisor`] over your broker, watching every call the supervisor makes into
//! it through a thin observer, and calls the broker directly where the contract is the broker's
//! own. Each check gets a fresh broker from your factory:
//!
//! | check | what must hold |
//! |---|---|
//! | `capacity` | with more jobs than slots, at no point are more tokens granted and not yet released than [`SlotBroker::capacity`] says |
//! | `one release per token` | every token the broker granted is released exactly once, and nothing it never granted is released |
//! | `no double grant` | a token's slot is never granted again while that token is outstanding |
//! | `fencing` | a slot's lease id increases strictly from one holder to the next, so a later holder's token fences off an earlier one's |
//! | `fifo` | callers queued one after another are served in that order as slots come back |
//! | `cancel safety` | callers that give up while waiting leak nothing: every slot comes back and a later acquire is served |
//! | `close` | shutdown closes the broker exactly once, after its last release |
//! | `lost leases` | (a broker that [`renews`](SlotBroker::renews), with [`Conformance::lose_with`]) a lease the broker loses ends under its holder, and is still released once |
//! | `bad tokens` | a release of a token the broker never granted, or of one already released, is refused with an error |
//!
//! A check that cannot apply to a broker (no capacity reported, no way to make it lose a lease)
//! is reported as skipped, with the reason.
//!
//! # Examples
//!
//! ```
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! use leasehold::LocalBroker;
//! use leasehold::conformance::Conformance;
//!
//! let report = Conformance::new(|| async { LocalBroker::new(2) }).run().await;
//! report.assert_passed();
//! assert!(report.checks().iter().any(|c| c.name() == "fifo" && c.passed()));
//! # });
//! ```

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::{
    AcquireRequest, BrokerError, BrokerEvents, JobSpec, Lease, SlotBroker, SlotToken, Supervisor,
};

/// How long one step of a check may take before it counts as a hang.
const STEP: Duration = Duration::from_secs(30);

type Loser<B> = Arc<dyn Fn(&B, SlotToken) + Send + Sync>;
type Restorer<B> = Arc<dyn Fn(&B) + Send + Sync>;

/// The suite, for brokers made by `make` (one fresh broker per check).
pub struct Conformance<B, F> {
    make: F,
    lose: Option<(Loser<B>, Restorer<B>)>,
}

impl<B, F> fmt::Debug for Conformance<B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conformance")
            .field("lose", &self.lose.is_some())
            .finish_non_exhaustive()
    }
}

impl<B, F, Fut> Conformance<B, F>
where
    B: SlotBroker,
    F: Fn() -> Fut,
    Fut: Future<Output = B>,
{
    /// The suite for the brokers `make` builds (an async factory: a remote broker connects).
    /// Each must report its capacity ([`SlotBroker::capacity`]) for the capacity check to
    /// apply, and should have at least two slots (the FIFO and cancel checks hold every slot,
    /// then queue callers behind them). Give each broker a pool of its own: one check's
    /// leftovers must not reach the next.
    pub fn new(make: F) -> Self {
        Self { make, lose: None }
    }

    /// How to make the broker lose a granted lease (cut it off from its coordinator, revoke
    /// the lease there), and how to undo that once the lease has ended, for a broker that
    /// [`renews`](SlotBroker::renews): without it, the `lost leases` check is skipped.
    pub fn lose_with(
        mut self,
        lose: impl Fn(&B, SlotToken) + Send + Sync + 'static,
        restore: impl Fn(&B) + Send + Sync + 'static,
    ) -> Self {
        self.lose = Some((Arc::new(lose), Arc::new(restore)));
        self
    }

    /// Runs every check and reports each one's outcome.
    ///
    /// Needs a multi-threaded tokio runtime, or a current-thread one that the broker does not
    /// block. Every step is bounded (30 s): a hang is a failure, not a stuck test.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a check dropped half-way leaves its supervisor to shut down on its own.
    pub async fn run(&self) -> Report {
        let mut checks = Vec::new();
        let (capacity, releases, double, fencing) = self.churn().await;
        checks.push(Check::new("capacity", capacity));
        checks.push(Check::new("one release per token", releases));
        checks.push(Check::new("no double grant", double));
        checks.push(Check::new("fencing", fencing));
        checks.push(Check::new("fifo", self.fifo().await));
        checks.push(Check::new("cancel safety", self.cancel_safety().await));
        checks.push(Check::new("close", self.close().await));
        checks.push(Check::new("lost leases", self.lost_leases().await));
        checks.push(Check::new("bad tokens", self.bad_tokens().await));
        Report { checks }
    }

    async fn observed(&self) -> (Observed<B>, Option<u32>) {
        let broker = (self.make)().await;
        let capacity = broker.capacity();
        (Observed::new(broker), capacity)
    }

    /// More jobs than slots, all at once: capacity, one release per token, no double grant,
    /// fencing.
    async fn churn(&self) -> (Outcome, Outcome, Outcome, Outcome) {
        let (broker, capacity) = self.observed().await;
        let run = async {
            let sup = start(&broker).await?;
            let jobs = 4 * capacity.unwrap_or(4).clamp(1, 16);
            let mut tasks = Vec::new();
            for n in 0..jobs {
                let sup = sup.clone();
                tasks.push(tokio::spawn(async move {
                    let job = JobSpec::new(format!("conformance-{n}")).expect("a valid id");
                    sup.run(job, |_ctx| async {
                        tokio::task::yield_now().await;
                        Ok::<_, std::convert::Infallible>(())
                    })
                    .await
                }));
            }
            for task in tasks {
                let ran = bounded("a job", task).await?;
                ran.map_err(|e| format!("a job's task failed: {e}"))?
                    .map_err(|e| format!("a job failed: {e}"))?;
            }
            answered("shutdown", sup.shutdown()).await?;
            Ok::<_, String>(())
        };
        let ran = run.await;
        let log = broker.log();
        let capacity = match (&ran, capacity) {
            (Err(e), _) => Outcome::Failed(e.clone()),
            (Ok(()), None) => Outcome::Skipped("the broker reports no capacity".into()),
            (Ok(()), Some(n)) if log.most_outstanding > n as usize => Outcome::Failed(format!(
                "{} tokens outstanding at once, capacity {n}",
                log.most_outstanding
            )),
            (Ok(()), Some(_)) => Outcome::Passed,
        };
        let releases = match &ran {
            Err(e) => Outcome::Failed(e.clone()),
            Ok(()) => log.releases_once(),
        };
        let double = match &log.double_grants[..] {
            [] => Outcome::Passed,
            grants => Outcome::Failed(format!("granted while still outstanding: {grants:?}")),
        };
        let fencing = log.fencing();
        (capacity, releases, double, fencing)
    }

    /// Every slot held; callers queued one after another; slots given back one by one.
    async fn fifo(&self) -> Outcome {
        let (broker, capacity) = self.observed().await;
        let Some(n) = capacity else {
            return Outcome::Skipped("the broker reports no capacity".into());
        };
        let check = async {
            let sup = start(&broker).await?;
            let mut held = hold_all(&sup, n).await?;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let mut waiters = Vec::new();
            for i in 0..3usize {
                let (caller, tx) = (sup.clone(), tx.clone());
                waiters.push(tokio::spawn(async move {
                    let lease = caller.acquire().await;
                    let _ = tx.send(i);
                    lease
                }));
                until("the caller to queue", || sup.stats().waiting == i + 1).await?;
            }
            let mut order = Vec::new();
            for _ in 0..3 {
                let mut lease = held.pop().ok_or("fewer slots than capacity")?;
                answered("a release", lease.release()).await?;
                order.push(
                    bounded("the next grant", rx.recv())
                        .await?
                        .ok_or("no grant")?,
                );
                if held.is_empty() {
                    break;
                }
            }
            for waiter in waiters {
                if let Ok(Ok(Ok(mut lease))) = tokio::time::timeout(STEP, waiter).await {
                    let _ = lease.release().await;
                }
            }
            for mut lease in held {
                let _ = lease.release().await;
            }
            answered("shutdown", sup.shutdown()).await?;
            let expected: Vec<usize> = (0..order.len()).collect();
            if order != expected {
                return Err(format!(
                    "served in the order {order:?}, queued as {expected:?}"
                ));
            }
            Ok(())
        };
        check.await.into()
    }

    /// Every slot held; callers give up while they wait; every slot comes back.
    async fn cancel_safety(&self) -> Outcome {
        let (broker, capacity) = self.observed().await;
        let Some(n) = capacity else {
            return Outcome::Skipped("the broker reports no capacity".into());
        };
        let check = async {
            let sup = start(&broker).await?;
            let held = hold_all(&sup, n).await?;
            // Callers that wait, then leave: one dropped, one cancelled through its token.
            let gone = tokio::spawn({
                let sup = sup.clone();
                async move { sup.acquire().await }
            });
            until("a caller to queue", || sup.stats().waiting == 1).await?;
            gone.abort();
            let _ = gone.await;
            let cancel = tokio_util::sync::CancellationToken::new();
            let job = JobSpec::new("conformance-cancelled")
                .expect("a valid id")
                .with_cancel(cancel.clone());
            let run = tokio::spawn({
                let sup = sup.clone();
                async move {
                    sup.run(job, |_ctx| async { Ok::<_, std::convert::Infallible>(()) })
                        .await
                }
            });
            until("a job to queue", || sup.stats().waiting == 1).await?;
            cancel.cancel();
            let ran = answered("the cancelled job", run).await?;
            if !matches!(&ran, Err(e) if e.code() == "LEASE_ACQUIRE_CANCELLED") {
                return Err(format!("a job cancelled while waiting ended {ran:?}"));
            }
            until("both callers to leave", || sup.stats().waiting == 0).await?;
            for mut lease in held {
                answered("a release", lease.release()).await?;
            }
            let mut again = answered("an acquire after the cancellations", sup.acquire()).await?;
            answered("its release", again.release()).await?;
            answered("shutdown", sup.shutdown()).await?;
            let log = broker.log();
            if log.outstanding != 0 {
                return Err(format!(
                    "{} tokens still outstanding after every caller left and every lease was released",
                    log.outstanding
                ));
            }
            log.releases_once().into_result()
        };
        check.await.into()
    }

    /// Shutdown closes the broker once, after its last release.
    async fn close(&self) -> Outcome {
        let (broker, _) = self.observed().await;
        let check = async {
            let sup = start(&broker).await?;
            // A lease left for the shutdown to release.
            let _lease = answered("an acquire", sup.acquire()).await?;
            let report = answered("shutdown", sup.shutdown()).await?;
            if let Some(e) = report.broker_close_failed {
                return Err(format!("the broker's close failed: {e}"));
            }
            let log = broker.log();
            match (log.closes, log.outstanding_at_close) {
                (1, Some(0)) => Ok(()),
                (1, Some(n)) => Err(format!("closed with {n} tokens still outstanding")),
                (n, _) => Err(format!("closed {n} times")),
            }
        };
        check.await.into()
    }

    /// A lease the broker loses ends under its holder, and is released once.
    async fn lost_leases(&self) -> Outcome {
        let (broker, _) = self.observed().await;
        if !broker.0.broker.renews() {
            return Outcome::Skipped("the broker does not renew leases".into());
        }
        let Some((lose, restore)) = self.lose.clone() else {
            return Outcome::Skipped(
                "no way to make the broker lose a lease (Conformance::lose_with)".into(),
            );
        };
        let check = async {
            let sup = start(&broker).await?;
            let mut lease = answered("an acquire", sup.acquire()).await?;
            let token = lease.token().map_err(|e| e.to_string())?;
            lose(&broker.0.broker, token);
            let ended = bounded("the lease to end under its holder", lease.lost()).await;
            restore(&broker.0.broker);
            ended?;
            let _ = bounded("its release", lease.release()).await?;
            answered("shutdown", sup.shutdown()).await?;
            broker.log().releases_once().into_result()
        };
        check.await.into()
    }

    /// Releases of tokens the broker never granted, or already took back, are refused.
    async fn bad_tokens(&self) -> Outcome {
        let broker = (self.make)().await;
        let check = async {
            let foreign = SlotToken::new(u32::MAX - 1, u64::MAX - 1);
            if bounded("a foreign release", broker.release(foreign))
                .await?
                .is_ok()
            {
                return Err(format!(
                    "a release of {foreign}, never granted, was accepted"
                ));
            }
            let token = answered(
                "an acquire",
                broker.acquire(AcquireRequest::new(1, Some("conformance"))),
            )
            .await?;
            bounded("a release", broker.release(token))
                .await?
                .map_err(|e| format!("the first release of {token} failed: {e}"))?;
            if bounded("a second release", broker.release(token))
                .await?
                .is_ok()
            {
                return Err(format!("a second release of {token} was accepted"));
            }
            let _ = bounded("close", broker.close()).await?;
            Ok(())
        };
        check.await.into()
    }
}

/// What the suite found.
#[derive(Debug, Clone)]
pub struct Report {
    checks: Vec<Check>,
}

impl Report {
    /// Every check, in the order it ran.
    pub fn checks(&self) -> &[Check] {
        &self.checks
    }

    /// Whether no check failed (skipped ones do not count).
    pub fn passed(&self) -> bool {
        !self
            .checks
            .iter()
            .any(|c| matches!(c.outcome, Outcome::Failed(_)))
    }

    /// Panics, listing every failed check, if any failed; prints the skipped ones.
    ///
    /// # Panics
    ///
    /// When a check failed.
    pub fn assert_passed(&self) {
        for check in &self.checks {
            if let Outcome::Skipped(why) = &check.outcome {
                eprintln!("broker conformance: {} skipped: {why}", check.name);
            }
        }
        assert!(self.passed(), "broker conformance failed:\n{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for check in &self.checks {
            writeln!(f, "{check}")?;
        }
        Ok(())
    }
}

/// One check and its outcome.
#[derive(Debug, Clone)]
pub struct Check {
    name: &'static str,
    outcome: Outcome,
}

impl Check {
    fn new(name: &'static str, outcome: impl Into<Outcome>) -> Self {
        Self {
            name,
            outcome: outcome.into(),
        }
    }

    /// The check's name (see the table in the module docs).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether it ran and held.
    pub fn passed(&self) -> bool {
        matches!(self.outcome, Outcome::Passed)
    }

    /// Why it failed, if it did.
    pub fn failure(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Failed(why) => Some(why),
            _ => None,
        }
    }

    /// Why it did not apply, if it was skipped.
    pub fn skipped(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Skipped(why) => Some(why),
            _ => None,
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Outcome::Passed => write!(f, "{}: passed", self.name),
            Outcome::Failed(why) => write!(f, "{}: FAILED: {why}", self.name),
            Outcome::Skipped(why) => write!(f, "{}: skipped: {why}", self.name),
        }
    }
}

#[derive(Debug, Clone)]
enum Outcome {
    Passed,
    Failed(String),
    Skipped(String),
}

impl Outcome {
    fn into_result(self) -> Result<(), String> {
        match self {
            Self::Failed(why) => Err(why),
            Self::Passed | Self::Skipped(_) => Ok(()),
        }
    }
}

impl From<Result<(), String>> for Outcome {
    fn from(result: Result<(), String>) -> Self {
        match result {
            Ok(()) => Self::Passed,
            Err(why) => Self::Failed(why),
        }
    }
}

/// [`bounded`] for a call that answers with a `Result`: its error too becomes the failure.
async fn answered<T, E: fmt::Display>(
    what: &str,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    bounded(what, fut).await?.map_err(|e| e.to_string())
}

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(STEP, fut)
        .await
        .map_err(|_| format!("{what} did not end within {STEP:?}"))
}

/// Yields until `cond` holds (the supervisor answers in its own turns), within the step bound.
async fn until(what: &str, mut cond: impl FnMut() -> bool) -> Result<(), String> {
    bounded(what, async {
        while !cond() {
            tokio::task::yield_now().await;
        }
    })
    .await
}

async fn start<B: SlotBroker>(broker: &Observed<B>) -> Result<Supervisor, String> {
    Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .map_err(|e| format!("the supervisor did not start on the broker: {e}"))
}

async fn hold_all(sup: &Supervisor, n: u32) -> Result<Vec<Lease>, String> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(answered("an acquire", sup.acquire()).await?);
    }
    Ok(held)
}

/// The broker under test, with a record of every call the supervisor made into it.
struct Observed<B>(Arc<Watched<B>>);

impl<B> Clone for Observed<B> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

struct Watched<B> {
    broker: B,
    log: Mutex<Log>,
}

#[derive(Debug, Default, Clone)]
struct Log {
    /// Tokens granted and not yet released, by slot.
    granted: HashMap<u32, SlotToken>,
    outstanding: usize,
    most_outstanding: usize,
    /// The lease id each slot was last granted under.
    last_lease: HashMap<u32, u64>,
    /// Grants whose lease id did not increase over the slot's previous holder's: (slot,
    /// previous, new).
    fencing_breaks: Vec<(u32, u64, u64)>,
    /// Releases per token (of every token granted).
    releases: HashMap<SlotToken, u32>,
    /// Releases of tokens never granted.
    strangers: Vec<SlotToken>,
    double_grants: Vec<SlotToken>,
    closes: u32,
    outstanding_at_close: Option<usize>,
}

impl Log {
    fn releases_once(&self) -> Outcome {
        if let Some(t) = self.strangers.first() {
            return Outcome::Failed(format!("{t} was released but never granted"));
        }
        let mut wrong: Vec<String> = self
            .releases
            .iter()
            .filter(|(_, n)| **n != 1)
            .map(|(t, n)| format!("{t} released {n} times"))
            .collect();
        wrong.sort();
        match wrong.first() {
            None => Outcome::Passed,
            Some(_) => Outcome::Failed(wrong.join(", ")),
        }
    }

    fn fencing(&self) -> Outcome {
        match self.fencing_breaks.first() {
            None => Outcome::Passed,
            Some((slot, before, after)) => Outcome::Failed(format!(
                "slot {slot} granted under lease id {after} after lease id {before}"
            )),
        }
    }
}

impl<B> Observed<B> {
    fn new(broker: B) -> Self {
        Self(Arc::new(Watched {
            broker,
            log: Mutex::new(Log::default()),
        }))
    }

    fn log(&self) -> Log {
        self.0.log.lock().clone()
    }
}

impl<B: SlotBroker> SlotBroker for Observed<B> {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        let token = self.0.broker.acquire(request).await?;
        let mut log = self.0.log.lock();
        if log.granted.insert(token.slot_id(), token).is_some() {
            log.double_grants.push(token);
        } else {
            log.outstanding += 1;
        }
        log.most_outstanding = log.most_outstanding.max(log.outstanding);
        // A slot is granted again only after its release (checked above), so the order of its
        // grants is the order they are seen here, concurrent acquires of other slots aside.
        if let Some(before) = log.last_lease.insert(token.slot_id(), token.lease_id())
            && token.lease_id() <= before
        {
            log.fencing_breaks
                .push((token.slot_id(), before, token.lease_id()));
        }
        log.releases.entry(token).or_insert(0);
        Ok(token)
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        {
            let mut log = self.0.log.lock();
            match log.releases.get_mut(&token) {
                Some(n) => *n += 1,
                None => log.strangers.push(token),
            }
            if log.granted.get(&token.slot_id()) == Some(&token) {
                log.granted.remove(&token.slot_id());
                log.outstanding -= 1;
            }
        }
        self.0.broker.release(token).await
    }

    fn capacity(&self) -> Option<u32> {
        self.0.broker.capacity()
    }

    fn renews(&self) -> bool {
        self.0.broker.renews()
    }

    fn keep_alive(&self, token: SlotToken) -> impl Future<Output = BrokerError> + Send {
        self.0.broker.keep_alive(token)
    }

    fn attach(&self, events: BrokerEvents) {
        self.0.broker.attach(events);
    }

    async fn close(&self) -> Result<(), BrokerError> {
        {
            let mut log = self.0.log.lock();
            log.closes += 1;
            log.outstanding_at_close = Some(log.outstanding);
        }
        self.0.broker.close().await
    }
}
