//! A conformance suite for [`SlotBroker`] implementations (feature `conformance`).
//!
//! Run it against your own broker to learn whether it keeps the promises the supervisor relies
//! on. A broker that passes gets the supervisor's guarantees; one that breaks a promise fails the
//! check for that promise, and the failure says what was seen.
//!
//! The suite drives each broker two ways, through a thin observer that records every call:
//!
//! - **directly**, as a second supervisor or another process would: acquires beyond the
//!   capacity in flight at once, acquires dropped at each of their await points and while they
//!   wait, tokens released in every order, stale and foreign tokens, close called twice;
//! - **through supervisors**: one or two [`Supervisor`]s over one broker, running jobs, leases
//!   and cancellations, so that the broker is polled exactly as the supervisor polls it (the
//!   first poll inline with a no-op waker, the rest in a task; acquires nobody needs any more
//!   dropped in flight).
//!
//! Each check below covers one promise of the [`SlotBroker`] contract, quoted from its docs.
//! The first three are judged over every call the suite made, in every check, into every broker
//! it built; the others by their own run.
//!
//! | check | the promise it covers |
//! |---|---|
//! | `capacity` | "A broker whose `capacity()` is `Some(n)` never has more than `n` tokens granted and not yet released, however many acquires are in flight at once, from one supervisor or several." |
//! | `no double grant` | "A broker never grants a slot that is still held, and never hands out a lease id that a live token carries." |
//! | `fencing` | "Each grant of a slot carries a lease id greater than every lease id that slot was granted under before." |
//! | `release` | "A release of a token the broker granted answers `Ok`, and the slot can be granted again." With a capacity reported, also after tokens are released out of order, directly and by supervisors' jobs: a slot released while others are held is taken again, and every slot is taken again at the end. |
//! | `fifo` | "A broker that makes acquires wait while every slot is held serves them in the order they arrived." Three wait, one after another; a newcomer asks as the first slot comes back, and must not overtake them (a broker whose queue is full may refuse it). A broker that lets a newcomer take a slot freed for a waiter is caught when the newcomer's first poll comes before the woken waiter runs: always on a current-thread runtime. (Skipped for a broker that refuses when every slot is held.) |
//! | `cancel safety` | "An acquire dropped at any await point — before it answers, while it waits, or as a slot is being handed to it — takes nothing: a slot it had taken goes back, or to the next waiter." |
//! | `bad tokens` | "A release of a token the broker did not grant, of one already released, or of a stale one (its slot now has a newer holder) is refused with an error, and takes nothing from the current holder." Among them, a live slot under a wrong lease id and a live lease id under another held slot; the tokens they mimic still release, each once. |
//! | `close` | "Closing again answers `Ok` at once." Also the supervisor's side: its shutdown closes the broker once, after its last release. |
//! | `lost leases` | (a broker that [`renews`](SlotBroker::renews), with [`Conformance::lose_with`]) "The future resolves only when the lease is lost, or may lapse before it can be renewed again": the lease then ends under its holder, and is still released once. A renewal that resolves before the check made the broker lose anything (moments after the grant, with its lease fresh) fails. |
//! | `supervised` | "Its futures are ordinary futures: each poll registers the waker it is given." Jobs run through two supervisors sharing the broker all end, and every token the broker granted them is released exactly once. |
//!
//! A check that cannot apply to a broker (no capacity reported, no waiting, no way to make it
//! lose a lease) is reported as skipped, with the reason.
//!
//! # Waiting brokers
//!
//! The `fifo` and `cancel safety` checks need acquires that wait *at the broker*. The suite
//! starts one, and counts it as waiting once it has been polled, has not answered, and either
//! [`Conformance::waiting_with`] says the broker has queued it, or (without that probe) the
//! [`settle`](Conformance::settle) window has passed. A broker that registers a waiter on the
//! acquire's first poll needs neither (`settle(Duration::ZERO)`); a remote one should give the
//! probe or a window longer than its round trip.
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
//! assert!(report.checks().iter().any(|c| c.name() == "capacity" && c.passed()));
//! # });
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::{
    AcquireRequest, BrokerError, BrokerEvents, JobSpec, SlotBroker, SlotToken, Supervisor,
};

type Loser<B> = Arc<dyn Fn(&B, SlotToken) + Send + Sync>;
type Restorer<B> = Arc<dyn Fn(&B) + Send + Sync>;
type Waiting<B> = Arc<dyn Fn(&B, &AcquireRequest) -> bool + Send + Sync>;

/// The check names, in the order they are reported.
const CAPACITY: &str = "capacity";
const NO_DOUBLE_GRANT: &str = "no double grant";
const FENCING: &str = "fencing";
const RELEASE: &str = "release";
const FIFO: &str = "fifo";
const CANCEL_SAFETY: &str = "cancel safety";
const BAD_TOKENS: &str = "bad tokens";
const CLOSE: &str = "close";
const LOST_LEASES: &str = "lost leases";
const SUPERVISED: &str = "supervised";

/// The suite, for brokers made by `make` (a fresh broker for each part of each check).
pub struct Conformance<B, F> {
    make: F,
    lose: Option<(Loser<B>, Restorer<B>)>,
    waiting: Option<Waiting<B>>,
    settle: Duration,
    step: Duration,
}

impl<B, F> fmt::Debug for Conformance<B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conformance")
            .field("lose", &self.lose.is_some())
            .field("waiting", &self.waiting.is_some())
            .field("settle", &self.settle)
            .field("step", &self.step)
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
    ///
    /// Each broker must report its capacity ([`SlotBroker::capacity`]) for the checks that
    /// hold every slot to apply, and should have at least two slots. Give each broker a pool of
    /// its own: one check's leftovers must not reach the next.
    pub fn new(make: F) -> Self {
        Self {
            make,
            lose: None,
            waiting: None,
            settle: Duration::from_millis(250),
            step: Duration::from_secs(30),
        }
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

    /// A probe that says whether the acquire made with this request is waiting at the broker
    /// (has taken its place in the broker's queue). With it, the suite waits for the probe
    /// instead of the [`settle`](Self::settle) window before it counts an acquire as waiting.
    pub fn waiting_with(
        mut self,
        waiting: impl Fn(&B, &AcquireRequest) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.waiting = Some(Arc::new(waiting));
        self
    }

    /// How long after its first poll an acquire that has not answered counts as waiting at the
    /// broker, when no [`waiting_with`](Self::waiting_with) probe is given (250 ms by default).
    /// `Duration::ZERO` suits a broker that takes its place in the queue on the first poll.
    pub fn settle(mut self, window: Duration) -> Self {
        self.settle = window;
        self
    }

    /// How long one step of a check (an acquire that should be served, a release, a job, a
    /// shutdown) may take before it counts as a hang (30 s by default).
    pub fn step(mut self, bound: Duration) -> Self {
        self.step = bound;
        self
    }

    /// Runs every check and reports each one's outcome.
    ///
    /// Needs a multi-threaded tokio runtime, or a current-thread one that the broker does not
    /// block. Every step is bounded (see [`step`](Self::step)): a hang is a failure, not a
    /// stuck test.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a check dropped half-way leaves its supervisors to shut down on their
    /// own, and its broker unclosed.
    pub async fn run(&self) -> Report {
        let mut seen = Vec::new();
        let crowd = self.crowd(&mut seen).await;
        let (churn, churn_leak) = self.churn(&mut seen).await;
        let release = self.release(&mut seen).await;
        let fifo = self.fifo(&mut seen).await;
        let cancel = self.cancel_safety(&mut seen).await;
        let bad = self.bad_tokens(&mut seen).await;
        let close = self.close(&mut seen).await;
        let lost = self.lost_leases(&mut seen).await;
        let (supervised, supervised_leak) = self.supervised(&mut seen).await;
        let checks = vec![
            Check::new(CAPACITY, crowd.and(|| judge_capacity(&seen))),
            Check::new(NO_DOUBLE_GRANT, churn.and(|| judge_double_grants(&seen))),
            Check::new(FENCING, judge_fencing(&seen)),
            Check::new(RELEASE, release.and(|| churn_leak).and(|| supervised_leak)),
            Check::new(FIFO, fifo),
            Check::new(CANCEL_SAFETY, cancel),
            Check::new(BAD_TOKENS, bad),
            Check::new(CLOSE, close),
            Check::new(LOST_LEASES, lost),
            Check::new(SUPERVISED, supervised),
        ];
        Report { checks }
    }

    async fn fresh(&self, part: &'static str) -> Observed<B> {
        Observed::new(part, (self.make)().await)
    }

    fn direct(&self, broker: &Observed<B>) -> Direct<B> {
        Direct {
            broker: broker.clone(),
            waiting: self.waiting.clone(),
            settle: self.settle,
            step: self.step,
            requests: Arc::new(AtomicU64::new(1)),
        }
    }

    /// `capacity`: more acquires than slots in flight at once, all started before any
    /// answers; slots given back one by one while the rest wait. The capacity itself is judged
    /// over every part of the run.
    async fn crowd(&self, seen: &mut Vec<Log>) -> Outcome {
        let broker = self.fresh("acquires beyond the capacity at once").await;
        let Some(n) = broker.capacity() else {
            seen.push(broker.log());
            return Outcome::Skipped("the broker reports no capacity".into());
        };
        let direct = self.direct(&broker);
        let ran = async {
            let mut held: Vec<SlotToken> = Vec::new();
            let mut flight: FuturesUnordered<_> =
                (0..2 * n + 1).map(|_| direct.acquire()).collect();
            loop {
                let next = tokio::select! {
                    biased;
                    next = flight.next() => Ok(next),
                    () = direct.all_waiting() => Err(()),
                };
                match next {
                    Ok(Some(Ok(token))) => held.push(token),
                    Ok(Some(Err(_))) => {}
                    Ok(None) => break,
                    // The rest wait at the broker. Give a slot back.
                    Err(()) if held.is_empty() => break,
                    Err(()) => {
                        let token = held.remove(0);
                        let _ = self.bounded("a release", direct.release(token)).await?;
                    }
                }
            }
            drop(flight);
            for token in held {
                let _ = self.bounded("a release", direct.release(token)).await?;
            }
            let _ = self.bounded("close", broker.close()).await?;
            Ok(())
        };
        let ran: Result<(), String> = ran.await;
        seen.push(broker.log());
        ran.into()
    }

    /// `no double grant` and `fencing`: slots released in an order other than the one they
    /// were taken in, each taken again while the others are held; then jobs through a
    /// supervisor. Both are judged over every part of the run. With a capacity, also
    /// `release` (the second outcome): each slot released out of order is taken again while
    /// the others are held, and every slot is taken again at the end.
    async fn churn(&self, seen: &mut Vec<Log>) -> (Outcome, Outcome) {
        let broker = self.fresh("tokens released out of order").await;
        let capacity = broker.capacity();
        let n = capacity.unwrap_or(1).clamp(1, 16);
        let direct = self.direct(&broker);
        let mut leak = Ok(());
        let ran = async {
            let mut held = direct.take(n).await?;
            for round in 0..2 * n as usize {
                if held.is_empty() {
                    break;
                }
                // Middle, last, first, ... : never only the newest.
                let at = (round * 7 + held.len() / 2) % held.len();
                let token = held.remove(at);
                let _ = self.bounded("a release", direct.release(token)).await?;
                match tokio::time::timeout(self.step, direct.acquire()).await {
                    Ok(Ok(token)) => held.push(token),
                    // With fewer tokens held than the capacity, a slot is free: the one just
                    // released, unless the broker lost it.
                    outcome if capacity.is_some() && leak.is_ok() => {
                        let why = match outcome {
                            Ok(Err(e)) => e.to_string(),
                            _ => format!("no answer within {:?}", self.step),
                        };
                        leak = Err(format!(
                            "{}: after {token} was released out of order, with {} of {n} slots held, no slot could be taken: {why}",
                            broker.0.log.lock().part,
                            held.len()
                        ));
                    }
                    _ => {}
                }
            }
            for token in held {
                let _ = self.bounded("a release", direct.release(token)).await?;
            }
            let sup = start(&broker).await?;
            let jobs: Vec<_> = (0..4 * n)
                .map(|i| tokio::spawn(yielding_job(sup.clone(), format!("conformance-churn-{i}"))))
                .collect();
            for job in jobs {
                let _ = self.bounded("a job", job).await?;
            }
            if capacity.is_some() && leak.is_ok() {
                leak = self.taken_again(&broker, &direct, n).await?;
            }
            self.answered("shutdown", sup.shutdown()).await?;
            Ok(())
        };
        let ran: Result<(), String> = ran.await;
        seen.push(broker.log());
        (ran.into(), leak.into())
    }

    /// Once every release made so far has answered, every slot is taken again (and given back
    /// in the order taken): `Err` names the leak. The outer `Err` is a step that hung.
    async fn taken_again(
        &self,
        broker: &Observed<B>,
        direct: &Direct<B>,
        n: u32,
    ) -> Result<Result<(), String>, String> {
        self.until("the releases to answer", || {
            let log = broker.0.log.lock();
            log.releasing == 0 && (log.outstanding.is_empty() || !log.double_grants.is_empty())
        })
        .await?;
        // A double grant is not released (that could free the live holder's slot): the
        // double grant is the failure, judged on its own.
        if !broker.0.log.lock().double_grants.is_empty() {
            return Ok(Ok(()));
        }
        match direct.take(n).await {
            Ok(again) => {
                direct.release_all(again).await;
                Ok(Ok(()))
            }
            Err(e) => Ok(Err(format!(
                "{}: after tokens were released out of order, every slot back: {e}",
                broker.0.log.lock().part
            ))),
        }
    }

    /// `release`: every slot taken, given back, and taken again.
    async fn release(&self, seen: &mut Vec<Log>) -> Outcome {
        let broker = self.fresh("every slot released and taken again").await;
        let n = broker.capacity().unwrap_or(1).clamp(1, 16);
        let direct = self.direct(&broker);
        let ran = async {
            for round in ["", " again"] {
                let held = direct
                    .take(n)
                    .await
                    .map_err(|e| format!("after every slot was released{round}: {e}"))?;
                for token in held {
                    self.bounded("a release", direct.release(token))
                        .await?
                        .map_err(|e| {
                            format!("the release of {token}, which it granted, failed: {e}")
                        })?;
                }
            }
            let _ = self.bounded("close", broker.close()).await?;
            Ok(())
        };
        let ran: Result<(), String> = ran.await;
        seen.push(broker.log());
        ran.into()
    }

    /// `fifo`: every slot held; three acquires wait, one after another; slots come back one by
    /// one.
    async fn fifo(&self, seen: &mut Vec<Log>) -> Outcome {
        let broker = self
            .fresh("waiting acquires served as slots come back")
            .await;
        let Some(n) = broker.capacity() else {
            seen.push(broker.log());
            return Outcome::Skipped("the broker reports no capacity".into());
        };
        let direct = self.direct(&broker);
        let ran = async {
            let mut give_back = direct.take(n).await?;
            let mut waiters = Vec::new();
            for i in 0..3 {
                let mut waiter = direct.waiter().numbered(i);
                match direct.settled(&mut waiter).await? {
                    None => waiters.push(waiter),
                    Some(answer) if i == 0 => {
                        if let Ok(token) = answer {
                            give_back.push(token);
                        }
                        direct.release_all(give_back).await;
                        let _ = self.bounded("close", broker.close()).await?;
                        return Ok(Some(match answer {
                            Ok(token) => format!(
                                "an acquire with every slot held was granted {token} (see capacity)"
                            ),
                            Err(e) => format!(
                                "the broker does not queue: an acquire with every slot held answered at once ({e})"
                            ),
                        }));
                    }
                    Some(Ok(token)) => {
                        give_back.push(token);
                        direct.release_all(give_back).await;
                        direct.drop_all(waiters).await;
                        return Err(format!(
                            "acquire {i} was granted {token} at once while acquire 0 waited"
                        ));
                    }
                    // A broker may bound its queue: what it queued is still served in order.
                    Some(Err(_)) => break,
                }
            }
            let queued = waiters.len();
            let mut order = Vec::new();
            let mut failure = None;
            while order.len() < queued {
                let Some(token) = (!give_back.is_empty()).then(|| give_back.remove(0)) else {
                    failure = Some(format!("no slot left to give back after {order:?}"));
                    break;
                };
                let _ = self.bounded("a release", direct.release(token)).await?;
                if order.is_empty() {
                    // A newcomer asks right as the first slot comes back, before any waiter
                    // runs again: it must not overtake them.
                    waiters.push(direct.waiter_now().numbered(queued));
                }
                let served = loop {
                    match Direct::<B>::next_answer(&mut waiters, self.step).await {
                        // A broker whose queue is full may refuse the newcomer: a refusal
                        // overtakes nobody.
                        Some((i, Err(_))) if i == queued => continue,
                        served => break served,
                    }
                };
                match served {
                    Some((i, Ok(token))) => {
                        order.push(i);
                        give_back.push(token);
                    }
                    Some((i, Err(e))) => {
                        failure = Some(format!(
                            "waiting acquire {i} failed when a slot came back: {e}"
                        ));
                        break;
                    }
                    None => {
                        failure = Some(format!(
                            "no waiting acquire was served within {:?} of a release (served so far: {order:?})",
                            self.step
                        ));
                        break;
                    }
                }
            }
            direct.drop_all(waiters).await;
            direct.release_all(give_back).await;
            let _ = self.bounded("close", broker.close()).await?;
            if let Some(failure) = failure {
                return Err(failure);
            }
            let expected: Vec<usize> = (0..queued).collect();
            if order != expected {
                return Err(format!(
                    "served in the order {order:?}, queued as {expected:?} (then a newcomer, {queued})"
                ));
            }
            Ok(None)
        };
        let ran: Result<Option<String>, String> = ran.await;
        seen.push(broker.log());
        match ran {
            Ok(None) => Outcome::Passed,
            Ok(Some(why)) => Outcome::Skipped(why),
            Err(why) => Outcome::Failed(why),
        }
    }

    /// `cancel safety`: acquires dropped at each await point, dropped while they wait and as a
    /// slot is handed to them, and given up through a supervisor while its acquires are in
    /// flight at the broker. After each part, every slot can be taken again.
    async fn cancel_safety(&self, seen: &mut Vec<Log>) -> Outcome {
        let parts = [
            self.dropped_in_flight(seen).await,
            self.dropped_while_waiting(seen).await,
            self.given_up_through_supervisors(seen).await,
        ];
        match parts.iter().find_map(|p| p.as_ref().err()) {
            Some(why) => Outcome::Failed(why.clone()),
            None => Outcome::Passed,
        }
    }

    /// Acquires on a free broker, each dropped after a number of polls or a short time.
    async fn dropped_in_flight(&self, seen: &mut Vec<Log>) -> Result<(), String> {
        let broker = self.fresh("acquires dropped at each await point").await;
        let n = broker.capacity().unwrap_or(1).clamp(1, 16);
        let direct = self.direct(&broker);
        let ran = async {
            let mut dropped = 0;
            for polls in 0..8 {
                if let Some(answer) = PollN::new(direct.acquire(), polls).await {
                    if let Ok(token) = answer {
                        let _ = self.bounded("a release", direct.release(token)).await?;
                    }
                } else {
                    dropped += 1;
                }
            }
            for after in [1, 5, 20] {
                match tokio::time::timeout(Duration::from_millis(after), direct.acquire()).await {
                    Ok(Ok(token)) => {
                        let _ = self.bounded("a release", direct.release(token)).await?;
                    }
                    Ok(Err(_)) => {}
                    Err(_) => dropped += 1,
                }
            }
            let held = direct.take(n).await.map_err(|e| {
                format!("after {dropped} acquires were dropped before they answered: {e}")
            })?;
            direct.release_all(held).await;
            let _ = self.bounded("close", broker.close()).await?;
            Ok(())
        };
        let ran = ran.await;
        seen.push(broker.log());
        ran
    }

    /// Every slot held, acquires waiting; some dropped while they wait, others just as a slot
    /// comes back to them. Applies to a broker that makes acquires wait.
    async fn dropped_while_waiting(&self, seen: &mut Vec<Log>) -> Result<(), String> {
        let broker = self.fresh("acquires dropped while they wait").await;
        let Some(n) = broker.capacity() else {
            seen.push(broker.log());
            return Ok(());
        };
        let direct = self.direct(&broker);
        let ran = async {
            let mut held = direct.take(n).await?;
            let mut waiters = Vec::new();
            for _ in 0..2 * n {
                let mut waiter = direct.waiter();
                match direct.settled(&mut waiter).await? {
                    None => waiters.push(waiter),
                    // The broker does not queue (or over-grants: see capacity).
                    Some(answer) => {
                        if let Ok(token) = answer {
                            held.push(token);
                        }
                        direct.drop_all(waiters).await;
                        direct.release_all(held).await;
                        let _ = self.bounded("close", broker.close()).await?;
                        return Ok(());
                    }
                }
            }
            let waited = waiters.len();
            // Two leave while they wait: one from the middle of the queue, the last one.
            let last = waiters.pop().expect("2n > 1 waiters");
            held.extend(direct.leave(last).await);
            if waiters.len() > 2 {
                let middle = waiters.remove(1);
                held.extend(direct.leave(middle).await);
            }
            // Then each slot comes back while the next waiter leaves: the slot may be on its
            // way to that waiter when it goes.
            let mut taken_back = Vec::new();
            while !held.is_empty() || !waiters.is_empty() {
                if !held.is_empty() {
                    let token = held.remove(0);
                    let _ = self.bounded("a release", direct.release(token)).await?;
                }
                if !waiters.is_empty() {
                    let next = waiters.remove(0);
                    taken_back.extend(direct.leave(next).await);
                }
                held.append(&mut taken_back);
            }
            let again = direct.take(n).await.map_err(|e| {
                format!("after {waited} waiting acquires were dropped, some as a slot came back to them: {e}")
            })?;
            direct.release_all(again).await;
            let _ = self.bounded("close", broker.close()).await?;
            Ok(())
        };
        let ran = ran.await;
        seen.push(broker.log());
        ran
    }

    /// Two supervisors over one broker: one holds every slot; the other's callers give up
    /// while its acquires are in flight at the broker (the supervisor drops them). Then the
    /// first takes every slot again.
    async fn given_up_through_supervisors(&self, seen: &mut Vec<Log>) -> Result<(), String> {
        let broker = self
            .fresh("callers that give up while acquires are in flight")
            .await;
        let Some(n) = broker.capacity() else {
            seen.push(broker.log());
            return Ok(());
        };
        let ran = async {
            let holder = start(&broker).await?;
            let other = start(&broker).await?;
            let mut held = Vec::new();
            for _ in 0..n {
                held.push(self.answered("an acquire", holder.acquire()).await?);
            }
            let cancels: Vec<CancellationToken> =
                (0..2).map(|_| CancellationToken::new()).collect();
            let mut calls = Vec::new();
            for (i, cancel) in cancels.iter().enumerate() {
                let sup = other.clone();
                let job = JobSpec::new(format!("conformance-gives-up-{i}"))
                    .expect("a valid id")
                    .with_cancel(cancel.clone());
                calls.push(tokio::spawn(async move {
                    sup.run(job, |_ctx| async { Ok::<_, std::convert::Infallible>(()) })
                        .await
                        .map(|_| ())
                        .map_err(|e| e.code())
                }));
            }
            let leaver = {
                let sup = other.clone();
                tokio::spawn(async move { sup.acquire().await.map(drop).map_err(|e| e.code()) })
            };
            // Until each caller waits with the other supervisor's acquires in flight at the
            // broker (and queued there), or has been refused (a broker that does not queue, or
            // whose queue is full, refuses what does not fit).
            let wanted = 3.min(n as usize);
            let mut last = String::new();
            self.until("the callers to wait with acquires in flight", || {
                let done = calls.iter().filter(|c| c.is_finished()).count()
                    + usize::from(leaver.is_finished());
                // Every refusal is the callers': the holder's acquires all answered with a
                // slot (a refusal would have ended the check).
                let (in_flight, refused) = (broker.in_flight(), broker.refused());
                let waiting = other.stats().waiting;
                last = format!(
                    "{done} ended, {waiting} waiting, {in_flight} acquires in flight, {refused} refused"
                );
                done == 3 || (waiting + done == 3 && in_flight + refused >= wanted)
            })
            .await
            .map_err(|e| format!("{e} ({last})"))?;
            let direct = self.direct(&broker);
            for request in broker.requests_in_flight() {
                direct.queued(&request).await?;
            }
            for cancel in &cancels {
                cancel.cancel();
            }
            leaver.abort();
            let _ = leaver.await;
            for call in calls {
                let _ = self.bounded("a cancelled job", call).await?;
            }
            self.until("the dropped acquires to end at the broker", || {
                other.stats().waiting == 0 && broker.in_flight() == 0
            })
            .await?;
            for mut lease in held {
                let _ = self.bounded("a release", lease.release()).await?;
            }
            let mut again = Vec::new();
            for i in 0..n {
                match tokio::time::timeout(self.step, holder.acquire()).await {
                    Ok(Ok(lease)) => again.push(lease),
                    outcome => {
                        let why = match outcome {
                            Ok(Err(e)) => e.to_string(),
                            _ => format!("no answer within {:?}", self.step),
                        };
                        return Err(format!(
                            "after a supervisor's callers gave up with its acquires in flight at the broker, only {i} of {n} slots could be taken again: {why}"
                        ));
                    }
                }
            }
            for mut lease in again {
                let _ = self.bounded("a release", lease.release()).await?;
            }
            self.answered("shutdown", other.shutdown()).await?;
            self.answered("shutdown", holder.shutdown()).await?;
            Ok(())
        };
        let ran = ran.await;
        seen.push(broker.log());
        ran
    }

    /// `bad tokens`: a foreign token, a token released twice, a stale token whose slot has a
    /// newer holder, a live slot under the wrong lease id, a live lease id under another held
    /// slot; none may be accepted, and none may free a slot: the tokens they mimic still
    /// release, each once.
    async fn bad_tokens(&self, seen: &mut Vec<Log>) -> Outcome {
        let broker = self.fresh("releases of bad tokens").await;
        let n = broker.capacity().unwrap_or(1).clamp(1, 16);
        let direct = self.direct(&broker);
        let ran = async {
            let refused = |what: String, answer: Result<(), BrokerError>| match answer {
                Ok(()) => Err(format!("a release of {what} was accepted")),
                Err(_) => Ok(()),
            };
            let foreign = SlotToken::new(u32::MAX - 1, u64::MAX - 1);
            let answer = self
                .bounded("a foreign release", direct.probe(foreign))
                .await?;
            refused(format!("{foreign} (never granted)"), answer)?;
            let first = direct.take(1).await?[0];
            // A broker whose every release answers an error fails `release`, not this check.
            let releases_answer_ok = self
                .bounded("a release", direct.release(first))
                .await?
                .is_ok();
            let answer = self
                .bounded("a second release", direct.probe(first))
                .await?;
            refused(format!("{first} (a second time)"), answer)?;
            let mut held = direct.take(n).await?;
            let mut outcome = Ok(());
            if let Some(holder) = held.iter().find(|t| t.slot_id() == first.slot_id()) {
                let answer = self.bounded("a stale release", direct.probe(first)).await?;
                outcome = refused(
                    format!("{first} (stale: its slot is held again as {holder})"),
                    answer,
                );
            }
            if outcome.is_ok() {
                let live = held[0];
                let wrong = SlotToken::new(live.slot_id(), live.lease_id() ^ (1 << 62));
                let answer = self
                    .bounded("a release under a wrong lease id", direct.probe(wrong))
                    .await?;
                outcome = refused(format!("{wrong} (its slot is held as {live})"), answer);
            }
            // A live lease id under another held slot: a broker that checks a release by its
            // lease id alone would free the lease's own slot.
            let crossed = (held.len() >= 2).then(|| (held[0], held[1]));
            if outcome.is_ok()
                && let Some((lease, slot)) = crossed
            {
                let wrong = SlotToken::new(slot.slot_id(), lease.lease_id());
                let answer = self
                    .bounded(
                        "a release of a live lease id under another slot",
                        direct.probe(wrong),
                    )
                    .await?;
                outcome = refused(
                    format!("{wrong} (its lease id is held as {lease}, its slot as {slot})"),
                    answer,
                );
            }
            if outcome.is_ok() && broker.capacity().is_some() {
                // Every slot is still held: nothing may be granted now.
                let mut extra = direct.waiter();
                match direct.settled(&mut extra).await? {
                    Some(Ok(token)) => {
                        outcome = Err(format!(
                            "with every slot held and only bad tokens released, {token} was granted"
                        ));
                        let _ = self.bounded("a release", direct.release(token)).await?;
                    }
                    Some(Err(_)) => {}
                    None => {
                        if let Some(token) = direct.leave(extra).await {
                            let _ = self.bounded("a release", direct.release(token)).await?;
                        }
                    }
                }
            }
            if outcome.is_ok()
                && let Some((lease, slot)) = crossed
            {
                // The real tokens still release, each exactly once.
                let mut rest = held.clone();
                rest.retain(|t| *t != lease && *t != slot);
                for token in [lease, slot] {
                    let answer = self.bounded("a release", direct.release(token)).await?;
                    if let Err(e) = answer
                        && releases_answer_ok
                    {
                        outcome = Err(format!(
                            "after bad tokens were refused, the release of {token}, which it granted, failed: {e}"
                        ));
                        break;
                    }
                    let again = self
                        .bounded("a second release", direct.probe(token))
                        .await?;
                    if let Err(e) = refused(format!("{token} (a second time)"), again) {
                        outcome = Err(e);
                        break;
                    }
                }
                held = rest;
            }
            direct.release_all(held).await;
            let _ = self.bounded("close", broker.close()).await?;
            outcome
        };
        let ran: Result<(), String> = ran.await;
        // A broker that took a bad token may have freed a slot the log still counts as held:
        // what follows is that failure's consequence, not a failure of another check.
        if ran.is_ok() {
            seen.push(broker.log());
        }
        ran.into()
    }

    /// `close`: a supervisor's shutdown closes the broker once, after its last release; a
    /// second close answers `Ok` at once.
    async fn close(&self, seen: &mut Vec<Log>) -> Outcome {
        let broker = self.fresh("closed by a supervisor, then again").await;
        let again = self.step.min(CLOSE_AGAIN);
        let ran = async {
            let sup = start(&broker).await?;
            // A lease left for the shutdown to release.
            let _lease = self.answered("an acquire", sup.acquire()).await?;
            let report = self.answered("shutdown", sup.shutdown()).await?;
            if let Some(e) = report.broker_close_failed {
                return Err(format!("the broker's close failed: {e}"));
            }
            let log = broker.log();
            match (log.closes, log.outstanding_at_close) {
                (1, Some(0)) => {}
                (1, Some(n)) => return Err(format!("closed with {n} tokens still outstanding")),
                (n, _) => return Err(format!("closed {n} times by one shutdown")),
            }
            closes_again(&broker, again).await
        };
        let ran: Result<(), String> = ran.await;
        seen.push(broker.log());
        if ran.is_err() {
            return ran.into();
        }
        let direct = self.fresh("closed twice without a supervisor").await;
        let ran = async {
            let _ = self.bounded("close", direct.close()).await?;
            closes_again(&direct, again).await
        };
        let ran: Result<(), String> = ran.await;
        seen.push(direct.log());
        ran.into()
    }

    /// `lost leases`: a lease the broker loses ends under its holder, and is released once; its
    /// renewal does not resolve before the broker was made to lose it.
    async fn lost_leases(&self, seen: &mut Vec<Log>) -> Outcome {
        let broker = self.fresh("a lease lost under its holder").await;
        if !broker.0.broker.renews() {
            seen.push(broker.log());
            return Outcome::Skipped("the broker does not renew leases".into());
        }
        let Some((lose, restore)) = self.lose.clone() else {
            seen.push(broker.log());
            return Outcome::Skipped(
                "no way to make the broker lose a lease (Conformance::lose_with)".into(),
            );
        };
        let ran = async {
            let sup = start(&broker).await?;
            let mut lease = self.answered("an acquire", sup.acquire()).await?;
            self.until("the supervisor to renew the lease", || {
                let (renewing, unprompted) = broker.renewals();
                renewing >= 1 || unprompted
            })
            .await?;
            // A lease already ended: a renewal that resolved unprompted, if that is why.
            let token = lease
                .token()
                .map_err(|e| broker.no_unprompted_loss().err().unwrap_or(e.to_string()))?;
            broker.0.log.lock().losing = true;
            lose(&broker.0.broker, token);
            let ended = self
                .bounded("the lease to end under its holder", lease.lost())
                .await;
            restore(&broker.0.broker);
            ended?;
            // A renewal that resolved before the loss was made (`losing` is set first, under
            // the log's lock), whether at its first poll or a little after.
            broker.no_unprompted_loss()?;
            let _ = self.bounded("its release", lease.release()).await?;
            self.answered("shutdown", sup.shutdown()).await?;
            broker.log().releases_once()
        };
        let ran: Result<(), String> = ran.await;
        seen.push(broker.log());
        ran.into()
    }

    /// `supervised`: jobs through two supervisors sharing the broker (more jobs than slots in
    /// each, so acquires wait at the broker when it queues) all end, and every token the broker
    /// granted them is released once.
    async fn supervised(&self, seen: &mut Vec<Log>) -> (Outcome, Outcome) {
        let broker = self.fresh("jobs through two supervisors").await;
        let capacity = broker.capacity();
        let mut leak = Ok(());
        let n = broker.capacity().unwrap_or(4).clamp(1, 16);
        let ran = async {
            let sups = [start(&broker).await?, start(&broker).await?];
            // The first jobs to get a slot hold it until every other job waits in its
            // supervisor's queue (a supervisor with room left has its acquires in flight at
            // the broker, and waits for them there) or has been refused.
            let (open, gate) = tokio::sync::watch::channel(false);
            let mut jobs = Vec::new();
            for (s, sup) in sups.iter().enumerate() {
                for i in 0..2 * n {
                    let id = format!("conformance-supervised-{s}-{i}");
                    jobs.push(tokio::spawn(gated_job(sup.clone(), id, gate.clone())));
                }
            }
            let total = jobs.len();
            self.until("the jobs to hold every slot and the others to wait", || {
                let active: usize = sups.iter().map(|s| s.stats().active).sum();
                let waiting: usize = sups.iter().map(|s| s.stats().waiting).sum();
                let ended = jobs.iter().filter(|j| j.is_finished()).count();
                active >= n as usize && active + waiting + ended >= total
            })
            .await?;
            let direct = self.direct(&broker);
            for request in broker.requests_in_flight() {
                direct.queued(&request).await?;
            }
            open.send_replace(true);
            for job in jobs {
                let _ = self.bounded("a job", job).await?;
            }
            // The jobs gave their slots back in whatever order they ended.
            if capacity.is_some() {
                leak = self.taken_again(&broker, &direct, n).await?;
            }
            for sup in &sups {
                self.answered("shutdown", sup.shutdown()).await?;
            }
            broker.log().releases_once()
        };
        let ran: Result<(), String> = ran.await;
        seen.push(broker.log());
        (ran.into(), leak.into())
    }

    /// [`Self::bounded`] for a call that answers with a `Result`: its error too becomes the
    /// failure.
    async fn answered<T, E: fmt::Display>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, E>>,
    ) -> Result<T, String> {
        self.bounded(what, fut).await?.map_err(|e| e.to_string())
    }

    async fn bounded<T>(&self, what: &str, fut: impl Future<Output = T>) -> Result<T, String> {
        bounded(self.step, what, fut).await
    }

    /// Yields until `cond` holds (the supervisor answers in its own turns), within the step.
    async fn until(&self, what: &str, mut cond: impl FnMut() -> bool) -> Result<(), String> {
        self.bounded(what, async {
            while !cond() {
                tokio::task::yield_now().await;
            }
        })
        .await
    }
}

/// The shortest window the crowd waits for an answer before it gives a slot back: the acquires
/// it starts all at once need a moment to reach a broker that answers at once.
const SETTLE_FLOOR: Duration = Duration::from_millis(20);

/// "At once", for a second close.
const CLOSE_AGAIN: Duration = Duration::from_secs(5);

async fn bounded<T>(step: Duration, what: &str, fut: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(step, fut)
        .await
        .map_err(|_| format!("{what} did not end within {step:?}"))
}

async fn closes_again<B: SlotBroker>(broker: &Observed<B>, bound: Duration) -> Result<(), String> {
    match tokio::time::timeout(bound, broker.close()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("a second close failed: {e}")),
        Err(_) => Err(format!("a second close did not answer within {bound:?}")),
    }
}

async fn start<B: SlotBroker>(broker: &Observed<B>) -> Result<Supervisor, String> {
    Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .map_err(|e| format!("the supervisor did not start on the broker: {e}"))
}

/// A job that yields once: long enough for its neighbours to queue behind it.
async fn yielding_job(sup: Supervisor, id: String) {
    let job = JobSpec::new(id).expect("a valid id");
    let _ = sup
        .run(job, |_ctx| async {
            tokio::task::yield_now().await;
            Ok::<_, std::convert::Infallible>(())
        })
        .await;
}

/// A job that holds its slot until `gate` opens.
async fn gated_job(sup: Supervisor, id: String, mut gate: tokio::sync::watch::Receiver<bool>) {
    let job = JobSpec::new(id).expect("a valid id");
    let _ = sup
        .run(job, |_ctx| async move {
            let _ = gate.wait_for(|open| *open).await;
            Ok::<_, std::convert::Infallible>(())
        })
        .await;
}

fn judge_capacity(seen: &[Log]) -> Outcome {
    let mut checked = false;
    for log in seen {
        let Some(n) = log.capacity else { continue };
        checked = true;
        if log.most_outstanding > n as usize {
            return Outcome::Failed(format!(
                "{}: {} tokens granted and not yet released at once, capacity {n}",
                log.part, log.most_outstanding
            ));
        }
    }
    if checked {
        Outcome::Passed
    } else {
        Outcome::Skipped("the broker reports no capacity".into())
    }
}

fn judge_double_grants(seen: &[Log]) -> Outcome {
    match seen
        .iter()
        .find_map(|log| log.double_grants.first().map(|g| (log.part, g)))
    {
        None => Outcome::Passed,
        Some((part, (new, live))) => Outcome::Failed(format!(
            "{part}: {new} was granted while {live} was still held"
        )),
    }
}

fn judge_fencing(seen: &[Log]) -> Outcome {
    match seen
        .iter()
        .find_map(|log| log.fencing_breaks.first().map(|b| (log.part, b)))
    {
        None => Outcome::Passed,
        Some((part, (slot, before, after))) => Outcome::Failed(format!(
            "{part}: slot {slot} granted under lease id {after} after lease id {before}"
        )),
    }
}

/// A broker used directly, as another supervisor or process would.
struct Direct<B> {
    broker: Observed<B>,
    waiting: Option<Waiting<B>>,
    settle: Duration,
    step: Duration,
    requests: Arc<AtomicU64>,
}

/// An acquire running in a task of its own, started by the suite.
struct Waiter {
    index: usize,
    request: AcquireRequest,
    polled: Arc<AtomicBool>,
    answer: oneshot::Receiver<Result<SlotToken, BrokerError>>,
    task: tokio::task::JoinHandle<()>,
}

impl<B: SlotBroker> Direct<B> {
    fn request(&self) -> AcquireRequest {
        let id = self.requests.fetch_add(1, Ordering::Relaxed);
        AcquireRequest::new(id, Some("conformance")).with_origin(self.broker.0.origin)
    }

    fn acquire(&self) -> impl Future<Output = Result<SlotToken, BrokerError>> + Send + use<B> {
        let (broker, request) = (self.broker.clone(), self.request());
        async move { broker.acquire(request).await }
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.broker.release(token).await
    }

    /// A release of a token the broker should refuse (not counted as the supervisor's).
    async fn probe(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.broker.0.broker.release(token).await
    }

    async fn release_all(&self, tokens: Vec<SlotToken>) {
        for token in tokens {
            let _ = tokio::time::timeout(self.step, self.release(token)).await;
        }
    }

    /// `n` slots, taken one after another, each within the step.
    async fn take(&self, n: u32) -> Result<Vec<SlotToken>, String> {
        let mut held = Vec::new();
        for i in 0..n {
            match tokio::time::timeout(self.step, self.acquire()).await {
                Ok(Ok(token)) => held.push(token),
                outcome => {
                    self.release_all(held).await;
                    let why = match outcome {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {:?}", self.step),
                    };
                    return Err(format!("only {i} of {n} slots could be taken: {why}"));
                }
            }
        }
        Ok(held)
    }

    /// Starts an acquire in a task of its own.
    fn waiter(&self) -> Waiter {
        let request = self.request();
        let polled = Arc::new(AtomicBool::new(false));
        let (tx, answer) = oneshot::channel();
        let fut = FirstPoll {
            fut: Box::pin({
                let (broker, request) = (self.broker.clone(), request.clone());
                async move { broker.acquire(request).await }
            }),
            polled: Arc::clone(&polled),
        };
        let task = tokio::spawn(async move {
            let _ = tx.send(fut.await);
        });
        Waiter {
            index: 0,
            request,
            polled,
            answer,
            task,
        }
    }

    /// Starts an acquire and polls it once here, at once, before anything else runs; then
    /// hands it to a task of its own.
    fn waiter_now(&self) -> Waiter {
        let request = self.request();
        let polled = Arc::new(AtomicBool::new(true));
        let (tx, answer) = oneshot::channel();
        let mut fut: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin({
            let (broker, request) = (self.broker.clone(), request.clone());
            async move { broker.acquire(request).await }
        });
        let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fut.as_mut()
                .poll(&mut Context::from_waker(std::task::Waker::noop()))
        }));
        let task = match first {
            Ok(Poll::Ready(result)) => {
                let _ = tx.send(result);
                tokio::spawn(async {})
            }
            // Told as a task's panic is: the acquire never answers.
            Err(_) => tokio::spawn(async {}),
            // The task's first poll gives it the waker it needs.
            Ok(Poll::Pending) => tokio::spawn(async move {
                let _ = tx.send(fut.await);
            }),
        };
        Waiter {
            index: 0,
            request,
            polled,
            answer,
            task,
        }
    }

    /// Waits until `waiter` counts as waiting at the broker (`None`), or has answered.
    async fn settled(
        &self,
        waiter: &mut Waiter,
    ) -> Result<Option<Result<SlotToken, BrokerError>>, String> {
        bounded(self.step, "an acquire's first poll", async {
            while !waiter.polled.load(Ordering::Acquire) {
                tokio::task::yield_now().await;
            }
        })
        .await?;
        let answer = match &self.waiting {
            Some(probe) => {
                let broker = &self.broker.0.broker;
                bounded(self.step, "the broker to queue an acquire", async {
                    loop {
                        if probe(broker, &waiter.request) {
                            return None;
                        }
                        if let Ok(answer) = waiter.answer.try_recv() {
                            return Some(answer);
                        }
                        tokio::task::yield_now().await;
                    }
                })
                .await?
            }
            None => match tokio::time::timeout(self.settle, &mut waiter.answer).await {
                Ok(answer) => {
                    Some(answer.map_err(|_| "an acquire's task ended without answering")?)
                }
                Err(_) => None,
            },
        };
        Ok(answer)
    }

    /// Resolves once every acquire in flight at the broker waits there: by the probe when
    /// there is one (and something is in flight), else after the settle window.
    async fn all_waiting(&self) {
        match &self.waiting {
            Some(probe) => {
                let broker = &self.broker.0.broker;
                loop {
                    let in_flight = self.broker.requests_in_flight();
                    if !in_flight.is_empty() && in_flight.iter().all(|r| probe(broker, r)) {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
            }
            None => tokio::time::sleep(self.settle.max(SETTLE_FLOOR)).await,
        }
    }

    /// Waits until the broker has queued an acquire it is running for a supervisor.
    async fn queued(&self, request: &AcquireRequest) -> Result<(), String> {
        match &self.waiting {
            Some(probe) => {
                let broker = &self.broker.0.broker;
                bounded(
                    self.step,
                    "the broker to queue a supervisor's acquire",
                    async {
                        while !probe(broker, request) && self.broker.is_in_flight(request) {
                            tokio::task::yield_now().await;
                        }
                    },
                )
                .await
            }
            None => {
                tokio::time::sleep(self.settle).await;
                Ok(())
            }
        }
    }

    /// Drops a waiting acquire; the slot, if it was granted before it went.
    async fn leave(&self, waiter: Waiter) -> Option<SlotToken> {
        let Waiter {
            mut answer, task, ..
        } = waiter;
        task.abort();
        let _ = task.await;
        answer.try_recv().ok().and_then(Result::ok)
    }

    /// Drops every waiting acquire, releasing what they were granted.
    async fn drop_all(&self, waiters: Vec<Waiter>) {
        for waiter in waiters {
            if let Some(token) = self.leave(waiter).await {
                let _ = tokio::time::timeout(self.step, self.release(token)).await;
            }
        }
    }

    /// The next waiter to answer, within `step`: its index (in the order it was started) and
    /// its answer. The waiter is taken out of `waiters`.
    async fn next_answer(
        waiters: &mut Vec<Waiter>,
        step: Duration,
    ) -> Option<(usize, Result<SlotToken, BrokerError>)> {
        let found = tokio::time::timeout(step, async {
            loop {
                for (at, waiter) in waiters.iter_mut().enumerate() {
                    if let Ok(answer) = waiter.answer.try_recv() {
                        return (at, waiter.index, answer);
                    }
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .ok()?;
        let (at, index, answer) = found;
        waiters.remove(at);
        Some((index, answer))
    }
}

impl Waiter {
    fn numbered(mut self, index: usize) -> Self {
        self.index = index;
        self
    }
}

/// Sets `polled` once the inner future has been polled (and not answered at once, or
/// answered).
struct FirstPoll<T> {
    fut: Pin<Box<dyn Future<Output = T> + Send>>,
    polled: Arc<AtomicBool>,
}

impl<T> Future for FirstPoll<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let polled = self.fut.as_mut().poll(cx);
        self.polled.store(true, Ordering::Release);
        polled
    }
}

/// Polls `fut` at most `polls` times (waking itself in between), then drops it: `None`.
struct PollN<F> {
    fut: Pin<Box<F>>,
    left: usize,
}

impl<F: Future> PollN<F> {
    fn new(fut: F, polls: usize) -> Self {
        Self {
            fut: Box::pin(fut),
            left: polls,
        }
    }
}

impl<F: Future> Future for PollN<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        match self.fut.as_mut().poll(cx) {
            Poll::Ready(value) => Poll::Ready(Some(value)),
            Poll::Pending => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

/// What the suite found.
#[derive(Debug, Clone)]
pub struct Report {
    checks: Vec<Check>,
}

impl Report {
    /// Every check, in the order of the table in the module docs.
    pub fn checks(&self) -> &[Check] {
        &self.checks
    }

    /// The names of the checks that failed.
    pub fn failed(&self) -> Vec<&'static str> {
        self.checks
            .iter()
            .filter(|c| c.failure().is_some())
            .map(Check::name)
            .collect()
    }

    /// Whether no check failed (skipped ones do not count).
    pub fn passed(&self) -> bool {
        self.failed().is_empty()
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
    /// This run's failure, else the judgement `then` gives.
    fn and(self, then: impl FnOnce() -> Outcome) -> Outcome {
        match self {
            Self::Failed(why) => Self::Failed(why),
            Self::Passed | Self::Skipped(_) => then(),
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

/// The broker under test, with a record of every call made into it.
struct Observed<B>(Arc<Watched<B>>);

impl<B> Clone for Observed<B> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

struct Watched<B> {
    broker: B,
    /// The origin of the suite's own direct acquires (random, as a supervisor's is).
    origin: u64,
    log: Mutex<Log>,
}

#[derive(Debug, Default, Clone)]
struct Log {
    /// Which part of which check drove the broker.
    part: &'static str,
    capacity: Option<u32>,
    /// Tokens granted and not yet released.
    outstanding: HashSet<SlotToken>,
    most_outstanding: usize,
    /// The lease id each slot was last granted under.
    last_lease: HashMap<u32, u64>,
    /// Grants whose lease id did not increase over the slot's previous holder's: (slot,
    /// previous, new).
    fencing_breaks: Vec<(u32, u64, u64)>,
    /// Tokens granted while another token held their slot or carried their lease id: (new,
    /// live).
    double_grants: Vec<(SlotToken, SlotToken)>,
    /// Releases per token (of every token granted).
    releases: HashMap<SlotToken, u32>,
    /// Releases of tokens never granted.
    strangers: Vec<SlotToken>,
    /// Releases asked of the broker and not yet answered (or dropped).
    releasing: usize,
    /// Acquires started and not yet answered (or dropped), by request.
    in_flight: Vec<AcquireRequest>,
    /// Acquires the broker answered with an error (a full queue, every slot held).
    refused: usize,
    /// Renewals (`keep_alive` futures) polled once without resolving.
    renewing: usize,
    /// Set once the check makes the broker lose a lease (`Conformance::lose_with`).
    losing: bool,
    /// Renewals that resolved before the check made the broker lose anything.
    unprompted_losses: Vec<SlotToken>,
    closes: u32,
    outstanding_at_close: Option<usize>,
}

impl Log {
    fn releases_once(&self) -> Result<(), String> {
        if let Some(t) = self.strangers.first() {
            return Err(format!("{t} was released but never granted"));
        }
        let doubled: HashSet<SlotToken> = self.double_grants.iter().map(|(new, _)| *new).collect();
        let mut wrong: Vec<String> = self
            .releases
            .iter()
            // A token refused as a double grant is not released (it could free the live
            // holder's slot): the double grant is the failure, judged on its own.
            .filter(|(t, n)| **n > 1 || (**n == 0 && !doubled.contains(t)))
            .map(|(t, n)| format!("{t} released {n} times"))
            .collect();
        wrong.sort();
        match wrong.first() {
            None => Ok(()),
            Some(_) => Err(wrong.join(", ")),
        }
    }

    fn granted(&mut self, token: SlotToken) {
        let live = self
            .outstanding
            .iter()
            .find(|t| t.slot_id() == token.slot_id() || t.lease_id() == token.lease_id())
            .copied();
        if let Some(live) = live {
            self.double_grants.push((token, live));
        }
        self.outstanding.insert(token);
        self.most_outstanding = self.most_outstanding.max(self.outstanding.len());
        // A slot is granted again only after its release (a double grant aside, judged on its
        // own), so the order of its grants is the order they are seen here.
        if let Some(before) = self.last_lease.insert(token.slot_id(), token.lease_id())
            && token.lease_id() <= before
        {
            self.fencing_breaks
                .push((token.slot_id(), before, token.lease_id()));
        }
        self.releases.entry(token).or_insert(0);
    }

    fn released(&mut self, token: SlotToken) {
        match self.releases.get_mut(&token) {
            Some(n) => *n += 1,
            None => self.strangers.push(token),
        }
        self.outstanding.remove(&token);
    }
}

impl<B: SlotBroker> Observed<B> {
    fn new(part: &'static str, broker: B) -> Self {
        let capacity = broker.capacity();
        Self(Arc::new(Watched {
            broker,
            origin: random_origin(),
            log: Mutex::new(Log {
                part,
                capacity,
                ..Log::default()
            }),
        }))
    }
}

impl<B> Observed<B> {
    fn log(&self) -> Log {
        self.0.log.lock().clone()
    }

    fn in_flight(&self) -> usize {
        self.0.log.lock().in_flight.len()
    }

    fn refused(&self) -> usize {
        self.0.log.lock().refused
    }

    /// Renewals polled once without resolving, and whether one resolved before the check made
    /// the broker lose anything.
    fn renewals(&self) -> (usize, bool) {
        let log = self.0.log.lock();
        (log.renewing, !log.unprompted_losses.is_empty())
    }

    /// Fails on the first renewal that resolved before the check made the broker lose anything.
    fn no_unprompted_loss(&self) -> Result<(), String> {
        match self.0.log.lock().unprompted_losses.first() {
            Some(token) => Err(format!(
                "the renewal of {token} resolved although the broker had lost nothing"
            )),
            None => Ok(()),
        }
    }

    fn requests_in_flight(&self) -> Vec<AcquireRequest> {
        self.0.log.lock().in_flight.clone()
    }

    fn is_in_flight(&self, request: &AcquireRequest) -> bool {
        self.0.log.lock().in_flight.contains(request)
    }
}

/// A per-run origin for the suite's own requests, as a supervisor picks one: a broker shared
/// with supervisors keys idempotency on `(origin, request_id)`.
fn random_origin() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now()) | 1
}

/// Counts a release as answered when it answers or is dropped.
struct Releasing<'a>(&'a Mutex<Log>);

impl Drop for Releasing<'_> {
    fn drop(&mut self) {
        self.0.lock().releasing -= 1;
    }
}

/// Takes an acquire out of the in-flight list when it answers or is dropped.
struct InFlight<'a> {
    log: &'a Mutex<Log>,
    request: AcquireRequest,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut log = self.log.lock();
        if let Some(at) = log.in_flight.iter().position(|r| *r == self.request) {
            log.in_flight.swap_remove(at);
        }
    }
}

impl<B: SlotBroker> SlotBroker for Observed<B> {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.0.log.lock().in_flight.push(request.clone());
        let _in_flight = InFlight {
            log: &self.0.log,
            request: request.clone(),
        };
        // Boxed, here and in every call below: a broker's futures can be large (tens of KB in
        // a debug build), and the suite's own futures, which hold them, are polled on the
        // caller's stack; held inline they overflowed a test thread's 2 MiB.
        let token = match Box::pin(self.0.broker.acquire(request)).await {
            Ok(token) => token,
            Err(e) => {
                self.0.log.lock().refused += 1;
                return Err(e);
            }
        };
        self.0.log.lock().granted(token);
        Ok(token)
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        // Counted as given back before the broker is asked: once asked, it may hand the slot
        // on before its answer reaches the caller.
        {
            let mut log = self.0.log.lock();
            log.released(token);
            log.releasing += 1;
        }
        let _releasing = Releasing(&self.0.log);
        Box::pin(self.0.broker.release(token)).await
    }

    fn capacity(&self) -> Option<u32> {
        self.0.broker.capacity()
    }

    fn renews(&self) -> bool {
        self.0.broker.renews()
    }

    fn keep_alive(&self, token: SlotToken) -> impl Future<Output = BrokerError> + Send {
        let mut renewal = Box::pin(self.0.broker.keep_alive(token));
        let watched = Arc::clone(&self.0);
        let mut polled = false;
        std::future::poll_fn(move |cx| {
            let answer = renewal.as_mut().poll(cx);
            let mut log = watched.log.lock();
            match answer {
                Poll::Ready(lost) => {
                    if !log.losing {
                        log.unprompted_losses.push(token);
                    }
                    Poll::Ready(lost)
                }
                Poll::Pending => {
                    if !polled {
                        polled = true;
                        log.renewing += 1;
                    }
                    Poll::Pending
                }
            }
        })
    }

    fn attach(&self, events: BrokerEvents) {
        self.0.broker.attach(events);
    }

    async fn close(&self) -> Result<(), BrokerError> {
        {
            let mut log = self.0.log.lock();
            log.closes += 1;
            log.outstanding_at_close = Some(log.outstanding.len());
        }
        Box::pin(self.0.broker.close()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of `releases` per token, `double` of them refused as double grants.
    fn log(releases: &[(SlotToken, u32)], double: &[SlotToken]) -> Log {
        Log {
            releases: releases.iter().copied().collect(),
            double_grants: double.iter().map(|t| (*t, SlotToken::new(0, 1))).collect(),
            ..Log::default()
        }
    }

    #[test]
    fn the_supervisors_releases_are_judged_once_per_token_granted() {
        let (a, b) = (SlotToken::new(0, 1), SlotToken::new(1, 2));
        assert_eq!(log(&[(a, 1), (b, 1)], &[]).releases_once(), Ok(()));
        // Released twice, or never: each named.
        let twice = log(&[(a, 2), (b, 1)], &[]).releases_once().unwrap_err();
        assert_eq!(twice, format!("{a} released 2 times"));
        let never = log(&[(a, 1), (b, 0)], &[]).releases_once().unwrap_err();
        assert_eq!(never, format!("{b} released 0 times"));
        // A double grant is not released (that could free the live holder's slot): its own
        // failure, not this one.
        assert_eq!(log(&[(a, 1), (b, 0)], &[b]).releases_once(), Ok(()));
        // A release of a token never granted.
        let stranger = SlotToken::new(7, 70);
        let mut strange = log(&[(a, 1)], &[]);
        strange.strangers.push(stranger);
        assert_eq!(
            strange.releases_once().unwrap_err(),
            format!("{stranger} was released but never granted")
        );
    }
}
