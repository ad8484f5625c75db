//! The shape floor: leasehold's shape written by hand with nothing else, the yardstick for a
//! lease by message (a `Semaphore` hands a permit over inside the releasing task's poll; a lease
//! by message to one owner cannot).
//!
//! One ractor actor owns the slots: a free list and a FIFO queue of waiters. A caller pushes its
//! request onto a shared queue and rings the actor only when the actor is idle (one doorbell
//! message per wake, however many requests wait); the actor drains every request per wake,
//! releases first and then grants in the order asked, and answers each by oneshot after its
//! effect. A release is awaited like an acquire.
//!
//! It is checked as it goes, from the callers' side: a caller handed a slot that another caller
//! holds, or more callers holding a slot at once than there are slots, panics that caller (and
//! the bench with it). A release of a slot the actor does not hold as granted ends the process
//! (a panic in the actor would stop only the actor, which ractor catches, and leave every caller
//! waiting). [`Owner::check_idle`] says every slot is free and nobody waits at the end. It
//! counts its wakes (doorbells handled), the requests they drained and the doorbells rung,
//! which the benches print next to their ratios.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A request as a caller leaves it on the shared queue.
enum Request {
    Acquire(oneshot::Sender<usize>),
    Release(usize, oneshot::Sender<()>),
}

/// The actor's messages: the doorbell, and the end-of-run check.
pub enum OwnerMsg {
    /// Requests wait on the queue.
    Ring,
    /// (free slots, waiters) now.
    Check(RpcReplyPort<(usize, usize)>),
}

/// What the callers and the actor share: the queue, whether the actor sleeps, the checks' state
/// and the counters.
struct Shared {
    requests: Mutex<Vec<Request>>,
    /// The actor sleeps with no doorbell on its way: the caller that flips this rings.
    idle: AtomicBool,
    /// Whether each slot is held, as its callers see it: a slot handed to a caller while
    /// another holds it is a double grant.
    held: Vec<AtomicBool>,
    /// Callers holding a slot now.
    holders: AtomicUsize,
    wakes: AtomicU64,
    drained: AtomicU64,
    rings: AtomicU64,
}

/// A handle to the owner actor; clones share it.
#[derive(Clone)]
pub struct Owner {
    shared: Arc<Shared>,
    actor: ActorRef<OwnerMsg>,
}

/// The owner's counters since its start (or its last [`Owner::take_counts`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnerCounts {
    /// Doorbells the actor handled (each drains the queue until it is empty).
    pub wakes: u64,
    /// Requests those turns drained (acquires and releases).
    pub drained: u64,
    /// Doorbell messages the callers sent.
    pub rings: u64,
}

impl Owner {
    /// Starts an owner of `slots` slots; the handle joins its actor.
    pub async fn start(slots: usize) -> (Owner, JoinHandle<()>) {
        let shared = Arc::new(Shared {
            requests: Mutex::new(Vec::new()),
            idle: AtomicBool::new(true),
            held: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            holders: AtomicUsize::new(0),
            wakes: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            rings: AtomicU64::new(0),
        });
        let (actor, join) = Actor::spawn(None, OwnerActor, Arc::clone(&shared))
            .await
            .expect("the owner actor starts");
        (Owner { shared, actor }, join)
    }

    fn push(&self, request: Request) {
        self.shared.requests.lock().push(request);
        if self.shared.idle.swap(false, Ordering::AcqRel) {
            self.shared.rings.fetch_add(1, Ordering::Relaxed);
            self.actor.cast(OwnerMsg::Ring).expect("the owner is alive");
        }
    }

    /// Waits for a slot, in the order asked.
    pub async fn acquire(&self) -> usize {
        let (tx, rx) = oneshot::channel();
        self.push(Request::Acquire(tx));
        let slot = rx.await.expect("the owner answers");
        let shared = &self.shared;
        assert!(
            !shared.held[slot].swap(true, Ordering::AcqRel),
            "slot {slot} handed to a caller while another holds it"
        );
        let holders = shared.holders.fetch_add(1, Ordering::AcqRel) + 1;
        assert!(
            holders <= shared.held.len(),
            "{holders} callers hold one of {} slots at once",
            shared.held.len()
        );
        slot
    }

    /// Gives `slot` back and waits until the owner has taken it.
    pub async fn release(&self, slot: usize) {
        let shared = &self.shared;
        assert!(
            shared.held[slot].swap(false, Ordering::AcqRel),
            "slot {slot} given back by a caller that does not hold it"
        );
        shared.holders.fetch_sub(1, Ordering::AcqRel);
        let (tx, rx) = oneshot::channel();
        self.push(Request::Release(slot, tx));
        rx.await.expect("the owner answers");
    }

    /// Panics unless every slot is free and nobody waits (no caller holds a slot, and the actor
    /// has every slot on its free list).
    pub async fn check_idle(&self) {
        let (free, waiting) =
            ractor::call!(self.actor, OwnerMsg::Check).expect("the owner answers");
        let slots = self.shared.held.len();
        assert_eq!(
            (free, waiting),
            (slots, 0),
            "the shape floor ended with {free} of {slots} slots free and {waiting} waiting"
        );
        assert_eq!(self.shared.holders.load(Ordering::Acquire), 0);
    }

    /// The end of a run: [`check_idle`](Self::check_idle), then the actor stopped and joined.
    pub async fn close(self, join: JoinHandle<()>) {
        self.check_idle().await;
        self.actor.stop(None);
        join.await.expect("the shape floor joins");
    }

    /// The counters since the last call, reset.
    pub fn take_counts(&self) -> OwnerCounts {
        OwnerCounts {
            wakes: self.shared.wakes.swap(0, Ordering::Relaxed),
            drained: self.shared.drained.swap(0, Ordering::Relaxed),
            rings: self.shared.rings.swap(0, Ordering::Relaxed),
        }
    }
}

struct OwnerActor;

/// The actor's own state: the free list, the waiters (oldest first) and which slots it has
/// granted.
struct OwnerState {
    shared: Arc<Shared>,
    free: VecDeque<usize>,
    waiters: VecDeque<oneshot::Sender<usize>>,
    granted: Vec<bool>,
}

/// A broken promise inside the actor ends the process: a panic there would stop only the actor
/// (ractor catches it) and leave every caller waiting.
fn broken(what: &str) -> ! {
    eprintln!("the shape floor broke its promise: {what}");
    std::process::exit(101)
}

impl OwnerState {
    /// Hands `slot` to the oldest waiter that still listens; `false` when none is left.
    fn grant(&mut self, slot: usize) -> bool {
        while let Some(waiter) = self.waiters.pop_front() {
            if waiter.send(slot).is_ok() {
                self.granted[slot] = true;
                return true;
            }
            // That caller gave up: the next one gets the slot.
        }
        false
    }

    /// One wake: drain the queue (releases first, then the acquires in order, then grants
    /// while slots are free), again while requests came in meanwhile, then sleep.
    fn drain(&mut self) {
        self.shared.wakes.fetch_add(1, Ordering::Relaxed);
        loop {
            let batch = std::mem::take(&mut *self.shared.requests.lock());
            self.shared
                .drained
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            let mut acquires = Vec::new();
            for request in batch {
                match request {
                    Request::Release(slot, done) => {
                        if !std::mem::replace(&mut self.granted[slot], false) {
                            broken(&format!("slot {slot} released while not granted"));
                        }
                        self.free.push_back(slot);
                        let _ = done.send(());
                    }
                    Request::Acquire(answer) => acquires.push(answer),
                }
            }
            self.waiters.extend(acquires);
            while let Some(slot) = self.free.pop_front() {
                if !self.grant(slot) {
                    self.free.push_front(slot);
                    break;
                }
            }
            // Sleep, unless a request came in after the drain and its caller saw the actor
            // awake (and so rang nobody): then this turn takes it.
            self.shared.idle.store(true, Ordering::Release);
            if self.shared.requests.lock().is_empty()
                || !self.shared.idle.swap(false, Ordering::AcqRel)
            {
                return;
            }
        }
    }
}

impl Actor for OwnerActor {
    type Msg = OwnerMsg;
    type State = OwnerState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        _myself: ActorRef<OwnerMsg>,
        shared: Arc<Shared>,
    ) -> Result<OwnerState, ActorProcessingErr> {
        let slots = shared.held.len();
        Ok(OwnerState {
            shared,
            free: (0..slots).collect(),
            waiters: VecDeque::new(),
            granted: vec![false; slots],
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<OwnerMsg>,
        msg: OwnerMsg,
        state: &mut OwnerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            OwnerMsg::Ring => state.drain(),
            OwnerMsg::Check(reply) => {
                let _ = reply.send((state.free.len(), state.waiters.len()));
            }
        }
        Ok(())
    }
}
