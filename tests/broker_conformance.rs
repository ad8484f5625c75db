//! The broker conformance suite (`leasehold::conformance`, feature `conformance`) can fail.
//!
//! The in-process broker and correct brokers of several kinds pass it (waiting or refusing, with
//! a bounded queue, remote ones whose acquires spend a round trip before they queue, one behind
//! a coordinator shared by every broker the suite makes, one that does not renew). Then a
//! gallery of brokers, each breaking exactly one promise of the `SlotBroker` contract, each
//! failing exactly the check for that promise. Several break their promise only under
//! concurrency (acquires racing, an acquire dropped at an await point, a waker given by the
//! supervisor's first poll, two waiters leaving back to back as a supervisor drops them), which
//! is where a suite that drives one supervisor at a time could not see them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;

use leasehold::conformance::{Conformance, Report};
use leasehold::{AcquireRequest, BrokerError, LocalBroker, SlotBroker, SlotToken};

const SLOTS: u32 = 3;

/// The polls a remote pool's acquire spends on its way: more than the suite's own turns take
/// to see the acquires in flight, so that it must wait for them to queue.
const ROUND_TRIP: usize = 50;

/// One promise broken, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Capacity: reads the count, yields, then takes a slot (numbering new ones past the pool
    /// when it has run out). Breaks only when acquires race.
    RacyCapacity,
    /// No double grant: the slot granted is the number of slots held, whichever is free.
    SlotByCount,
    /// Fencing: unique lease ids, each smaller than the last.
    LeaseIdsGoDown,
    /// Release: a release frees the slot but answers an error.
    ReleaseAnswersErr,
    /// FIFO: the newest waiter is served first.
    Lifo,
    /// FIFO: a release frees the slot and wakes the oldest waiter, which takes it when it runs
    /// again; an acquire that comes in between takes it first. Breaks only when a newcomer
    /// asks as a slot comes back.
    Barging,
    /// Cancel safety: an acquire that leaves while it waits stays in the queue, and a slot
    /// handed to it is lost. Breaks only when an acquire is dropped while it waits.
    LeaverStaysQueued,
    /// Cancel safety: an acquire that leaves from the middle of the queue stays in it (one at
    /// either end leaves), and a slot handed to it is lost.
    MiddleLeaverStays,
    /// Cancel safety: takes the slot, then yields before it answers. Breaks only when the
    /// acquire is dropped at that await point.
    TakesThenYields,
    /// Cancel safety: an acquire that leaves while it waits leaves the queue, but a slot
    /// already handed to it (not yet collected by its poll) is lost. Breaks only when the
    /// acquire is dropped as a slot is being handed to it.
    LeaksGrantInFlight,
    /// Bad tokens: accepts a release of any token.
    AcceptsAnyRelease,
    /// Bad tokens: checks a release by its slot only, so a stale token frees the slot's new
    /// holder.
    ReleasesBySlot,
    /// Bad tokens: checks a release by its lease id only, so a live lease id under another
    /// slot frees the lease's own slot.
    ReleasesByLease,
    /// Release: a released token that is not the oldest still held leaves the holder, but its
    /// slot never goes back to the free list (the release answers `Ok`). Breaks only when
    /// tokens are released out of order, and shows only when every slot is wanted again.
    LeaksOutOfOrder,
    /// Close: every close fails.
    CloseFails,
    /// Close: a second close fails.
    SecondCloseFails,
    /// Lost leases: the renewal never reports a loss.
    NeverReportsLoss,
    /// Ordinary futures: a waiting acquire keeps the waker of its first poll, which the
    /// supervisor makes with a no-op waker. Breaks only under a supervisor.
    KeepsFirstWaker,
    /// FIFO: a slot that comes back fails the oldest waiter (its acquire answers an error) and
    /// goes to the next one.
    FailsTheHead,
    /// Not one promise: no acquire is ever granted (each waits for ever). The suite must
    /// report it, not panic.
    NeverGrants,
    /// Cancel safety: an acquire dropped while it waits does not clean up in its `drop`: it
    /// records itself as *the* leaver and spawns the clean-up, which removes the leaver
    /// recorded from the queue. One record: a second leaver before the first clean-up runs
    /// overwrites the first, which stays queued, and a slot handed to it is lost. Breaks only
    /// when acquires leave back to back, as a supervisor drops those nobody needs any more.
    OneLeaverRecorded,
    /// Lost leases: the renewal reports a loss at once, whether the lease was lost or not.
    LosesAtOnce,
}

/// An in-process broker that makes acquires wait (or refuses when every slot is held), renews
/// its leases, and breaks the one promise its `Fault` names. A clone is the same broker.
#[derive(Clone)]
struct Pool {
    fault: Fault,
    queues: bool,
    /// At most this many acquires wait (those handed a slot they have not collected yet
    /// included); more are refused.
    queue_bound: Option<usize>,
    /// How many polls an acquire spends on its way to the pool before it takes a slot or a
    /// place in the queue, as a remote broker's request spends a round trip.
    round_trip: usize,
    /// Every grant by its request `(origin, id)`, in a coordinator shared by every broker a
    /// suite makes (as one etcd cluster serves every `EtcdBroker`): a request seen before is a
    /// retry, answered with its grant.
    ledger: Option<Arc<Mutex<Ledger>>>,
    /// Whether leases lapse unless renewed; one that does not renew reports a lost lease the
    /// moment `keep_alive` is polled, which the supervisor must then never do.
    renews: bool,
    /// Counts the tokens this broker granted and took back, when a test reads them.
    counts: Option<Arc<Counts>>,
    state: Arc<Mutex<State>>,
    lost: Arc<tokio::sync::watch::Sender<HashSet<SlotToken>>>,
}

#[derive(Default)]
struct State {
    free: VecDeque<u32>,
    held: HashSet<SlotToken>,
    /// The lease id each held slot is held under.
    holder: HashMap<u32, u64>,
    next_lease: u64,
    extra_slots: u32,
    waiters: VecDeque<u64>,
    granted: HashMap<u64, SlotToken>,
    /// Waiters to answer with an error (`FailsTheHead`).
    failed: HashSet<u64>,
    wakers: HashMap<u64, Waker>,
    /// The request (origin, id) of each waiter, for the suite's `waiting_with` probe.
    requests: HashMap<u64, (u64, u64)>,
    next_waiter: u64,
    closes: u32,
    /// The leaver the next clean-up removes (`OneLeaverRecorded`).
    leaver: Option<u64>,
}

impl Pool {
    /// Whether the acquire made with `request` waits in the queue (the suite's probe).
    fn is_waiting(&self, request: &AcquireRequest) -> bool {
        let key = (request.origin(), request.request_id());
        self.state.lock().requests.values().any(|r| *r == key)
    }

    fn new(fault: Fault, queues: bool) -> Self {
        Self {
            fault,
            queues,
            queue_bound: None,
            round_trip: 0,
            ledger: None,
            renews: true,
            counts: None,
            state: Arc::new(Mutex::new(State {
                free: (0..SLOTS).collect(),
                next_lease: 1,
                ..State::default()
            })),
            lost: Arc::new(tokio::sync::watch::Sender::new(HashSet::new())),
        }
    }

    fn with_ledger(mut self, ledger: Arc<Mutex<Ledger>>) -> Self {
        self.ledger = Some(ledger);
        self
    }

    fn without_renewal(mut self) -> Self {
        self.renews = false;
        self
    }

    fn with_round_trip(mut self, polls: usize) -> Self {
        self.round_trip = polls;
        self
    }

    fn counting(mut self, counts: Arc<Counts>) -> Self {
        self.counts = Some(counts);
        self
    }

    fn with_queue_bound(mut self, bound: usize) -> Self {
        self.queue_bound = Some(bound);
        self
    }

    fn lose(&self, token: SlotToken) {
        self.lost.send_modify(|lost| {
            lost.insert(token);
        });
    }

    fn restore(&self) {
        self.lost.send_modify(HashSet::clear);
    }

    fn mint(&self, state: &mut State, slot: u32) -> SlotToken {
        let lease = state.next_lease;
        state.next_lease += 1;
        let lease = match self.fault {
            Fault::LeaseIdsGoDown => 1_000_000 - lease,
            _ => lease,
        };
        let token = SlotToken::new(slot, lease);
        if let Some(counts) = &self.counts {
            counts.grants.fetch_add(1, Ordering::SeqCst);
        }
        state.held.insert(token);
        state.holder.insert(slot, lease);
        token
    }

    /// A slot free now, taken.
    fn take_now(&self, state: &mut State) -> Option<SlotToken> {
        if self.fault == Fault::SlotByCount {
            let held = state.held.len() as u32;
            return (held < SLOTS).then(|| self.mint(state, held));
        }
        let slot = state.free.pop_front()?;
        Some(self.mint(state, slot))
    }

    /// A slot given back: to the next waiter, or to the free list.
    fn hand_on(&self, state: &mut State, slot: u32) {
        if slot >= SLOTS || self.fault == Fault::SlotByCount {
            return;
        }
        if self.fault == Fault::Barging {
            state.free.push_back(slot);
            Self::wake_head(state);
            return;
        }
        if self.fault == Fault::FailsTheHead
            && let Some(head) = state.waiters.pop_front()
        {
            state.requests.remove(&head);
            state.failed.insert(head);
            if let Some(waker) = state.wakers.remove(&head) {
                waker.wake();
            }
        }
        let next = match self.fault {
            Fault::Lifo => state.waiters.pop_back(),
            _ => state.waiters.pop_front(),
        };
        match next {
            Some(waiter) => {
                let token = self.mint(state, slot);
                state.requests.remove(&waiter);
                state.granted.insert(waiter, token);
                if let Some(waker) = state.wakers.remove(&waiter) {
                    waker.wake();
                }
            }
            None => state.free.push_back(slot),
        }
    }

    /// Wakes the oldest waiter, to take a free slot when it runs again (`Barging`).
    fn wake_head(state: &mut State) {
        if let Some(head) = state.waiters.front()
            && let Some(waker) = state.wakers.get(head)
        {
            waker.wake_by_ref();
        }
    }

    fn give_back(&self, state: &mut State, token: SlotToken) {
        if let Some(counts) = &self.counts
            && state.held.contains(&token)
        {
            counts.taken_back.fetch_add(1, Ordering::SeqCst);
        }
        let oldest = state.held.iter().map(|t| t.lease_id()).min();
        state.held.remove(&token);
        if state.holder.get(&token.slot_id()) == Some(&token.lease_id()) {
            state.holder.remove(&token.slot_id());
        }
        if self.fault == Fault::LeaksOutOfOrder && oldest != Some(token.lease_id()) {
            return;
        }
        self.hand_on(state, token.slot_id());
    }

    /// A waiter leaves: out of the queue, and a slot handed to it goes on.
    fn leave(&self, state: &mut State, waiter: u64) {
        state.waiters.retain(|w| *w != waiter);
        state.wakers.remove(&waiter);
        state.requests.remove(&waiter);
        if let Some(token) = state.granted.remove(&waiter)
            && self.fault != Fault::LeaksGrantInFlight
        {
            self.give_back(state, token);
        }
        // A leaver that was woken for a free slot passes the wake on (`Barging`).
        if self.fault == Fault::Barging && !state.free.is_empty() {
            Pool::wake_head(state);
        }
    }

    fn unavailable() -> BrokerError {
        BrokerError::unavailable(format!("all {SLOTS} slots are held"))
    }
}

/// Grants by request, kept by a coordinator that outlives the brokers over it.
#[derive(Default)]
struct Ledger {
    grants: HashMap<(u64, u64), SlotToken>,
    /// Requests answered from the record: retries.
    retries: u64,
}

impl Ledger {
    fn retried(&mut self, request: (u64, u64)) -> Option<SlotToken> {
        let token = self.grants.get(&request).copied()?;
        self.retries += 1;
        Some(token)
    }
}

/// What a broker granted and took back.
#[derive(Default)]
struct Counts {
    grants: AtomicU64,
    taken_back: AtomicU64,
    /// Renewals polled.
    renewals: AtomicU64,
}

/// A waiting acquire.
struct Acquire<'a> {
    pool: &'a Pool,
    request: (u64, u64),
    /// Polls left on the way to the pool.
    on_the_way: usize,
    waiter: Option<u64>,
    done: bool,
}

impl Future for Acquire<'_> {
    type Output = Result<SlotToken, BrokerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let pool = self.pool;
        if self.on_the_way > 0 {
            self.on_the_way -= 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let mut state = pool.state.lock();
        let Some(waiter) = self.waiter else {
            if let Some(token) = pool.take_now(&mut state) {
                self.done = true;
                return Poll::Ready(Ok(token));
            }
            let full = pool
                .queue_bound
                .is_some_and(|bound| state.waiters.len() + state.granted.len() >= bound);
            if !pool.queues || full {
                self.done = true;
                return Poll::Ready(Err(Pool::unavailable()));
            }
            let waiter = state.next_waiter;
            state.next_waiter += 1;
            state.waiters.push_back(waiter);
            state.wakers.insert(waiter, cx.waker().clone());
            let request = self.request;
            state.requests.insert(waiter, request);
            drop(state);
            self.waiter = Some(waiter);
            return Poll::Pending;
        };
        if let Some(token) = state.granted.remove(&waiter) {
            drop(state);
            self.done = true;
            return Poll::Ready(Ok(token));
        }
        if state.failed.remove(&waiter) {
            drop(state);
            self.done = true;
            return Poll::Ready(Err(BrokerError::new("the slot went to another waiter")));
        }
        if pool.fault == Fault::Barging
            && state.waiters.front() == Some(&waiter)
            && let Some(token) = pool.take_now(&mut state)
        {
            state.waiters.pop_front();
            state.wakers.remove(&waiter);
            state.requests.remove(&waiter);
            // Two releases before the head ran woke it twice: the next one takes the other.
            if !state.free.is_empty() {
                Pool::wake_head(&mut state);
            }
            drop(state);
            self.done = true;
            return Poll::Ready(Ok(token));
        }
        if pool.fault != Fault::KeepsFirstWaker {
            state.wakers.insert(waiter, cx.waker().clone());
        }
        Poll::Pending
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        let (Some(waiter), false) = (self.waiter, self.done) else {
            return;
        };
        if self.pool.fault == Fault::LeaverStaysQueued {
            return;
        }
        if self.pool.fault == Fault::OneLeaverRecorded {
            self.pool.state.lock().leaver = Some(waiter);
            let pool = self.pool.clone();
            let clean_up = move || {
                let mut state = pool.state.lock();
                if let Some(waiter) = state.leaver.take() {
                    pool.leave(&mut state, waiter);
                }
            };
            // Outside a runtime (none here), at once.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(async move { clean_up() })),
                Err(_) => clean_up(),
            }
            return;
        }
        let pool = self.pool;
        let mut state = pool.state.lock();
        if pool.fault == Fault::MiddleLeaverStays
            && state.waiters.front() != Some(&waiter)
            && state.waiters.back() != Some(&waiter)
            && state.waiters.contains(&waiter)
        {
            return;
        }
        pool.leave(&mut state, waiter);
    }
}

impl SlotBroker for Pool {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        match self.fault {
            Fault::RacyCapacity => {
                let room = self.state.lock().held.len() < SLOTS as usize;
                if !room {
                    return Err(Pool::unavailable());
                }
                tokio::task::yield_now().await;
                let mut state = self.state.lock();
                let slot = match state.free.pop_front() {
                    Some(slot) => slot,
                    None => {
                        state.extra_slots += 1;
                        SLOTS - 1 + state.extra_slots
                    }
                };
                Ok(self.mint(&mut state, slot))
            }
            Fault::NeverGrants => std::future::pending().await,
            Fault::TakesThenYields => {
                let token = self.take_now(&mut self.state.lock());
                let token = token.ok_or_else(Pool::unavailable)?;
                tokio::task::yield_now().await;
                Ok(token)
            }
            _ => {
                let key = (request.origin(), request.request_id());
                let retried = self.ledger.as_ref().and_then(|l| l.lock().retried(key));
                if let Some(token) = retried {
                    return Ok(token);
                }
                let token = Acquire {
                    pool: self,
                    request: key,
                    on_the_way: self.round_trip,
                    waiter: None,
                    done: false,
                }
                .await?;
                if let Some(ledger) = &self.ledger {
                    ledger.lock().grants.insert(key, token);
                }
                Ok(token)
            }
        }
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        let mut state = self.state.lock();
        let known = match self.fault {
            Fault::AcceptsAnyRelease => true,
            Fault::ReleasesBySlot => state.holder.contains_key(&token.slot_id()),
            Fault::ReleasesByLease => state.held.iter().any(|t| t.lease_id() == token.lease_id()),
            _ => state.held.contains(&token),
        };
        if !known {
            return Err(BrokerError::invalid_response(format!(
                "{token} is not held"
            )));
        }
        let token = match self.fault {
            Fault::ReleasesBySlot => {
                let lease = state.holder[&token.slot_id()];
                SlotToken::new(token.slot_id(), lease)
            }
            Fault::ReleasesByLease => *state
                .held
                .iter()
                .find(|t| t.lease_id() == token.lease_id())
                .expect("known"),
            _ => token,
        };
        if state.held.contains(&token) {
            self.give_back(&mut state, token);
        }
        match self.fault {
            Fault::ReleaseAnswersErr => Err(BrokerError::new("the release was not confirmed")),
            _ => Ok(()),
        }
    }

    fn capacity(&self) -> Option<u32> {
        Some(SLOTS)
    }

    fn renews(&self) -> bool {
        self.renews
    }

    async fn keep_alive(&self, token: SlotToken) -> BrokerError {
        if let Some(counts) = &self.counts {
            counts.renewals.fetch_add(1, Ordering::SeqCst);
        }
        if !self.renews || self.fault == Fault::LosesAtOnce {
            return BrokerError::unavailable(format!("{token} is not renewed"));
        }
        let mut lost = self.lost.subscribe();
        loop {
            if self.fault != Fault::NeverReportsLoss && lost.borrow_and_update().contains(&token) {
                return BrokerError::unavailable(format!("{token} was lost"));
            }
            if lost.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    async fn close(&self) -> Result<(), BrokerError> {
        let closes = {
            let mut state = self.state.lock();
            state.closes += 1;
            state.closes
        };
        match self.fault {
            Fault::CloseFails => Err(BrokerError::unavailable(
                "the coordinator refused the close",
            )),
            Fault::SecondCloseFails if closes > 1 => Err(BrokerError::new("already closed")),
            _ => Ok(()),
        }
    }
}

/// The suite over fresh `Pool`s: they take their queue place on the first poll, so no settle
/// window is needed, and a hang shows within two seconds.
async fn suite(fault: Fault, queues: bool) -> Report {
    run(
        format!("{fault:?} (queues: {queues})"),
        move || Pool::new(fault, queues),
        Wait::Settled,
    )
    .await
}

/// How the suite learns that an acquire waits at the broker.
#[derive(Clone, Copy)]
enum Wait {
    /// From its first poll (no settle window): a `Pool` takes its queue place there.
    Settled,
    /// From the `Pool`'s queue probe, with a settle window of an hour: a wait on the window
    /// would fail the run on its step bound.
    Probed,
}

/// The suite over the brokers `make` builds, with a hang shown within two seconds.
async fn run(name: String, make: impl Fn() -> Pool, wait: Wait) -> Report {
    let suite = Conformance::new(move || std::future::ready(make()))
        .step(Duration::from_secs(2))
        .lose_with(|pool: &Pool, token| pool.lose(token), |pool| pool.restore());
    let suite = match wait {
        Wait::Settled => suite.settle(Duration::ZERO),
        Wait::Probed => suite
            .settle(Duration::from_secs(3600))
            .waiting_with(|pool: &Pool, request| pool.is_waiting(request)),
    };
    let report = suite.run().await;
    println!("{name}:\n{report}");
    report
}

/// Why the check `name` failed ("" if it did not).
fn failure_of<'a>(report: &'a Report, name: &str) -> &'a str {
    report
        .checks()
        .iter()
        .find(|c| c.name() == name)
        .and_then(|c| c.failure())
        .unwrap_or_default()
}

fn skipped(report: &Report) -> Vec<&'static str> {
    report
        .checks()
        .iter()
        .filter(|c| c.skipped().is_some())
        .map(|c| c.name())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_broker_passes_the_conformance_suite() {
    let report = Conformance::new(|| async { LocalBroker::new(3) })
        .settle(Duration::ZERO)
        .run()
        .await;
    println!("{report}");
    report.assert_passed();
    // It refuses when every slot is held (it never queues) and renews nothing.
    assert_eq!(skipped(&report), ["fifo", "lost leases"], "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_waiting_broker_passes_every_check_and_none_is_skipped() {
    let report = suite(Fault::None, true).await;
    report.assert_passed();
    assert_eq!(skipped(&report), Vec::<&str>::new(), "{report}");
}

/// A correct broker that lets at most `bound` acquires wait passes every check, none skipped.
async fn a_correct_broker_with_a_queue_of(bound: usize) {
    let report = run(
        format!("a pool with a queue of {bound}"),
        move || Pool::new(Fault::None, true).with_queue_bound(bound),
        Wait::Settled,
    )
    .await;
    report.assert_passed();
    assert_eq!(skipped(&report), Vec::<&str>::new(), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_broker_whose_full_queue_refuses_passes_every_check() {
    // Three may wait, a waiter handed a slot counts until it collects it: the fifo check's
    // newcomer is refused, which overtakes nobody.
    a_correct_broker_with_a_queue_of(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_broker_whose_queue_holds_one_passes_every_check_and_none_is_skipped() {
    // The second acquire with every slot held is refused: the first still waits, and is
    // served in order.
    a_correct_broker_with_a_queue_of(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_grants_as_many_leases_as_its_docs_say_and_gives_back_all_it_took() {
    let counters: Arc<parking_lot::Mutex<Vec<Arc<Counts>>>> = Arc::default();
    let made = Arc::clone(&counters);
    let report = Conformance::new(move || {
        let counts = Arc::new(Counts::default());
        made.lock().push(Arc::clone(&counts));
        async move { Pool::new(Fault::None, true).counting(counts) }
    })
    .settle(Duration::ZERO)
    .step(Duration::from_secs(2))
    .run()
    .await;
    report.assert_passed();
    // The second broker the suite makes is the churn's: its 3 slots taken, each of the
    // 2 × 3 rounds takes one again, then 4 × 3 jobs through a supervisor, then every slot
    // taken again.
    let counters = counters.lock();
    // (A waiting broker: the fifo check leaves its newcomer waiting when it is done, which
    // the suite must drop, not leave to take a slot it never gives back.)
    let churn = counters[1].grants.load(Ordering::SeqCst);
    assert_eq!(churn, 3 + 2 * 3 + 4 * 3 + 3);
    // The last is the supervised check's: two supervisors, each with twice as many jobs as
    // there are slots, then every slot taken again.
    let supervised = counters.last().unwrap().grants.load(Ordering::SeqCst);
    assert_eq!(supervised, 2 * 2 * 3 + 3);
    // Every broker it made has every slot back when the suite is done with it.
    for (i, counts) in counters.iter().enumerate() {
        let grants = counts.grants.load(Ordering::SeqCst);
        let back = counts.taken_back.load(Ordering::SeqCst);
        assert_eq!(
            back, grants,
            "broker {i} took back {back} of {grants} grants"
        );
    }
}

// On a current-thread runtime: the failed head and the next waiter (granted) are woken by the
// same release, and their answers arrive in that order; on two threads the grant's answer can
// arrive first, and the suite then names the next head it fails (acquire 2).
#[tokio::test]
async fn a_broker_that_fails_its_oldest_waiter_when_a_slot_comes_back_fails_the_fifo_check() {
    fails_only(
        Fault::FailsTheHead,
        true,
        "fifo",
        "waiting acquire 0 failed when a slot came back",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_never_grants_is_reported_not_panicked_on() {
    let report = suite(Fault::NeverGrants, true).await;
    assert!(!report.passed(), "{report}");
    // Nothing was granted, so nothing was over-granted: the crowd passes.
    let capacity = report
        .checks()
        .iter()
        .find(|c| c.name() == "capacity")
        .unwrap();
    assert!(capacity.passed(), "{report}");
    assert!(report.failed().contains(&"release"), "{report}");
    // The failure counts what it dropped: eight acquires after 0 to 7 polls, and three after
    // 1, 5 and 20 ms, none of which ever answered.
    let cancel = failure_of(&report, "cancel safety");
    assert!(
        cancel.contains("after 11 acquires were dropped before they answered"),
        "{cancel:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_refusing_broker_passes_every_check_but_fifo() {
    let report = suite(Fault::None, false).await;
    report.assert_passed();
    assert_eq!(skipped(&report), ["fifo"], "{report}");
}

/// Each broken broker fails exactly the check of the promise it breaks, for the reason it
/// breaks it (`says` is part of the failure's text).
async fn fails_only(fault: Fault, queues: bool, check: &str, says: &str) {
    let report = suite(fault, queues).await;
    assert_eq!(report.failed(), [check], "{fault:?}:\n{report}");
    let failure = failure_of(&report, check);
    assert!(
        failure.contains(says),
        "{fault:?}: {failure:?} does not say {says:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_over_grants_when_acquires_race_fails_the_capacity_check() {
    fails_only(
        Fault::RacyCapacity,
        false,
        "capacity",
        "7 tokens granted and not yet released at once, capacity 3",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_grants_a_held_slot_fails_the_no_double_grant_check() {
    fails_only(
        Fault::SlotByCount,
        false,
        "no double grant",
        "was granted while slot 2 lease 3 was still held",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_lease_ids_go_down_fails_the_fencing_check() {
    fails_only(
        Fault::LeaseIdsGoDown,
        true,
        "fencing",
        "granted under lease id 999996 after lease id 999999",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_releases_answer_an_error_fails_the_release_check() {
    fails_only(
        Fault::ReleaseAnswersErr,
        true,
        "release",
        "the release of slot 0 lease 1, which it granted, failed",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_serves_the_newest_waiter_first_fails_the_fifo_check() {
    fails_only(
        Fault::Lifo,
        true,
        "fifo",
        "served in the order [2, 3, 1], queued as [0, 1, 2] (then a newcomer, 3)",
    )
    .await;
}

/// On a current-thread runtime the newcomer's inline poll always comes before the woken waiter
/// runs, which is when a barging broker lets it overtake (on several threads, the waiter may
/// win the race, and the suite sees fair service that time).
#[tokio::test]
async fn a_broker_that_lets_a_newcomer_take_a_slot_freed_for_a_waiter_fails_the_fifo_check() {
    fails_only(
        Fault::Barging,
        true,
        "fifo",
        "served in the order [3, 0, 1], queued as [0, 1, 2] (then a newcomer, 3)",
    )
    .await;
}

/// On a current-thread runtime each leaver is dropped before it can collect the slot handed to
/// it, every time (on several threads it sometimes collects it first).
#[tokio::test]
async fn a_broker_that_loses_a_slot_handed_to_a_waiter_as_it_leaves_fails_the_cancel_safety_check()
{
    fails_only(Fault::LeaksGrantInFlight, true, "cancel safety", "after 6 waiting acquires were dropped, some as a slot came back to them: only 0 of 3 slots could be taken").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_hands_a_slot_to_a_waiter_that_left_fails_the_cancel_safety_check() {
    fails_only(Fault::LeaverStaysQueued, true, "cancel safety", "after 6 waiting acquires were dropped, some as a slot came back to them: only 0 of 3 slots could be taken").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_keeps_a_leaver_from_the_middle_of_its_queue_fails_the_cancel_safety_check() {
    fails_only(
        Fault::MiddleLeaverStays,
        true,
        "cancel safety",
        "some as a slot came back to them: only 2 of 3 slots could be taken",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_acquire_takes_a_slot_before_an_await_fails_the_cancel_safety_check() {
    fails_only(
        Fault::TakesThenYields,
        false,
        "cancel safety",
        "after 2 acquires were dropped before they answered: only 2 of 3 slots could be taken: broker unavailable: all 3 slots are held",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_accepts_a_release_of_a_token_it_never_granted_fails_the_bad_tokens_check() {
    fails_only(
        Fault::AcceptsAnyRelease,
        true,
        "bad tokens",
        "(never granted) was accepted",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_takes_a_stale_token_from_the_slots_new_holder_fails_the_bad_tokens_check() {
    fails_only(
        Fault::ReleasesBySlot,
        true,
        "bad tokens",
        "(stale: its slot is held again as slot 0 lease 4) was accepted",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_takes_a_live_lease_id_under_another_slot_fails_the_bad_tokens_check() {
    fails_only(
        Fault::ReleasesByLease,
        true,
        "bad tokens",
        "slot 2 lease 2 (its lease id is held as slot 1 lease 2, its slot as slot 2 lease 3) was accepted",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_close_fails_fails_the_close_check() {
    fails_only(
        Fault::CloseFails,
        true,
        "close",
        "the broker's close failed",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_second_close_fails_fails_the_close_check() {
    fails_only(
        Fault::SecondCloseFails,
        true,
        "close",
        "a second close failed",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_renewal_never_reports_a_loss_fails_the_lost_leases_check() {
    fails_only(
        Fault::NeverReportsLoss,
        true,
        "lost leases",
        "the lease to end under its holder did not end within 2s",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_keeps_the_waker_of_the_first_poll_fails_the_supervised_check() {
    fails_only(
        Fault::KeepsFirstWaker,
        true,
        "supervised",
        "a job did not end within 2s",
    )
    .await;
}

/// The suite with the queue probe, over fresh `Pool`s breaking `fault`.
async fn suite_with_probe(fault: Fault) -> Report {
    probed(format!("{fault:?}"), move || Pool::new(fault, true)).await
}

/// The suite with the queue probe, over the brokers `make` builds.
async fn probed(name: String, make: impl Fn() -> Pool) -> Report {
    run(format!("{name} (probed)"), make, Wait::Probed).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_queue_probe_a_correct_waiting_broker_passes_and_a_lifo_one_fails_fifo() {
    let report = suite_with_probe(Fault::None).await;
    report.assert_passed();
    assert_eq!(skipped(&report), Vec::<&str>::new(), "{report}");
    let report = suite_with_probe(Fault::Lifo).await;
    assert_eq!(report.failed(), ["fifo"], "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_says_each_checks_outcome_and_assert_passed_panics_on_a_failure() {
    let report = suite(Fault::CloseFails, false).await;
    let text = report.to_string();
    assert!(text.contains("capacity: passed\n"), "{text}");
    assert!(
        text.contains("fifo: skipped: the broker does not queue"),
        "{text}"
    );
    assert!(
        text.contains("close: FAILED: the broker's close failed: "),
        "{text}"
    );
    assert_eq!(text.lines().count(), report.checks().len());
    let close = report
        .checks()
        .iter()
        .find(|c| c.name() == "close")
        .unwrap();
    assert!(!close.passed() && close.failure().is_some() && close.skipped().is_none());
    let fifo = report.checks().iter().find(|c| c.name() == "fifo").unwrap();
    assert!(!fifo.passed() && fifo.failure().is_none() && fifo.skipped().is_some());
    let capacity = report
        .checks()
        .iter()
        .find(|c| c.name() == "capacity")
        .unwrap();
    assert!(capacity.passed() && capacity.failure().is_none() && capacity.skipped().is_none());
    assert!(!report.passed());
    let asserted = std::panic::catch_unwind(|| report.assert_passed());
    let message = *asserted.unwrap_err().downcast::<String>().unwrap();
    assert!(message.contains("close: FAILED"), "{message}");
    // The checks come in the order of the module's table.
    let names: Vec<&str> = report.checks().iter().map(|c| c.name()).collect();
    assert_eq!(
        names,
        [
            "capacity",
            "no double grant",
            "fencing",
            "release",
            "fifo",
            "cancel safety",
            "bad tokens",
            "close",
            "lost leases",
            "supervised"
        ]
    );
}

/// On a current-thread runtime the clean-up a leaver spawns runs before the suite's next
/// direct leave, every time; the supervisor drops the acquires nobody needs any more in one
/// turn.
#[tokio::test]
async fn a_broker_that_records_one_leaver_at_a_time_fails_the_cancel_safety_check_through_a_supervisor()
 {
    fails_only(
        Fault::OneLeaverRecorded,
        true,
        "cancel safety",
        "after a supervisor's callers gave up with its acquires in flight at the broker",
    )
    .await;
}

/// With the probe, the crowd gives a slot back only once every acquire still in flight waits
/// in the queue: a broker whose racing acquires are still on their way is given time to
/// over-grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_queue_probe_a_broker_that_over_grants_when_acquires_race_fails_the_capacity_check()
{
    let report = suite_with_probe(Fault::RacyCapacity).await;
    assert_eq!(report.failed(), ["capacity"], "{report}");
}

/// A correct broker whose acquires take a round trip before they queue, and whose queue holds
/// two: with the probe, the suite waits for each acquire a supervisor has in flight until it
/// queues or answers (here, one is refused at the end of its trip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_queue_probe_a_correct_remote_broker_with_a_queue_of_two_passes_every_check() {
    let report = probed("a remote pool with a queue of 2".into(), || {
        Pool::new(Fault::None, true)
            .with_round_trip(ROUND_TRIP)
            .with_queue_bound(2)
    })
    .await;
    report.assert_passed();
    assert_eq!(skipped(&report), Vec::<&str>::new(), "{report}");
}

/// With the probe, the suite gives up the supervisor's callers only once its acquires have
/// reached the broker's queue: before that, a leaver has nothing to leave, and a broker that
/// loses the first of two back-to-back leavers would pass.
#[tokio::test]
async fn with_a_queue_probe_a_remote_broker_that_records_one_leaver_at_a_time_fails_the_cancel_safety_check()
 {
    let report = probed("a remote pool that records one leaver".into(), || {
        Pool::new(Fault::OneLeaverRecorded, true).with_round_trip(ROUND_TRIP)
    })
    .await;
    assert_eq!(report.failed(), ["cancel safety"], "{report}");
    let failure = failure_of(&report, "cancel safety");
    assert!(
        failure.contains(
            "after a supervisor's callers gave up with its acquires in flight at the broker"
        ),
        "{failure:?}"
    );
}

/// A correct broker behind one coordinator for every broker the suite makes (as one etcd
/// cluster serves them all), which answers a request it has seen before with its grant: the
/// suite's own requests must not repeat another part's `(origin, request id)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_broker_whose_grants_outlive_it_in_a_shared_coordinator_passes_every_check() {
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let shared = Arc::clone(&ledger);
    let report = probed("a pool with a shared ledger".into(), move || {
        Pool::new(Fault::None, true).with_ledger(Arc::clone(&shared))
    })
    .await;
    report.assert_passed();
    assert_eq!(skipped(&report), Vec::<&str>::new(), "{report}");
    // The suite never retries: no request was answered from another part's record.
    let ledger = ledger.lock();
    assert_eq!(ledger.retries, 0);
    assert!(ledger.grants.len() > 50, "{}", ledger.grants.len());
}

/// A correct broker that does not renew: the supervisors the suite starts over it learn that
/// from the broker, through the suite's observer, and never poll its renewal (which would
/// report every lease lost at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_broker_that_does_not_renew_passes_every_check_but_lost_leases() {
    let counts = Arc::new(Counts::default());
    let made = Arc::clone(&counts);
    let report = probed("a pool that does not renew".into(), move || {
        Pool::new(Fault::None, true)
            .without_renewal()
            .counting(Arc::clone(&made))
    })
    .await;
    report.assert_passed();
    assert_eq!(skipped(&report), ["lost leases"], "{report}");
    assert_eq!(counts.renewals.load(Ordering::SeqCst), 0);
    assert!(counts.grants.load(Ordering::SeqCst) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_renewal_reports_a_loss_at_once_fails_the_lost_leases_check() {
    fails_only(
        Fault::LosesAtOnce,
        true,
        "lost leases",
        "resolved although the broker had lost nothing",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_broker_that_leaks_slots_released_out_of_order_fails_the_release_check() {
    fails_only(
        Fault::LeaksOutOfOrder,
        false,
        "release",
        "after slot 1 lease 2 was released out of order, with 2 of 3 slots held, no slot could be taken",
    )
    .await;
}
