//! The lease desk: the supervisor's public message interface for actors
//! ([`Supervisor::lease_desk`](crate::Supervisor::lease_desk)).
//!
//! A lease asked for by message is tied to an actor, its holder: it goes back through the
//! release pipeline once the holder has exited (its ractor status is `Stopped`) and the
//! [`ActorLease`] handed to it has been dropped (so a holder that keeps the `ActorLease` in its
//! state returns the slot only after its state is gone, wherever ractor drops it), or at once
//! when released by message. Each grant is kept by a task of its own that owns the explicit
//! [`Lease`](crate::Lease): the desk's mailbox never waits on a slot, a broker or an exit.

use std::fmt;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort};
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;

use super::core::{Ask, Want};
use super::handle::Supervisor;
use crate::broker::SlotToken;
use crate::error::{AcquireError, CleanupError, SupervisorStopped, codes};
use crate::lease::LeaseCell;

/// What the lease desk understands. Shaped for ractor's `call!`:
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use leasehold::{LeaseMsg, Supervisor};
/// use ractor::{Actor, ActorProcessingErr, ActorRef, call};
///
/// struct Baker;
///
/// impl Actor for Baker {
///     type Msg = ();
///     type State = Option<leasehold::ActorLease>;
///     type Arguments = ActorRef<LeaseMsg>;
///
///     async fn pre_start(
///         &self,
///         myself: ActorRef<()>,
///         desk: ActorRef<LeaseMsg>,
///     ) -> Result<Self::State, ActorProcessingErr> {
///         // The slot is this actor's until it exits (or releases it by message).
///         let lease = call!(desk, LeaseMsg::Acquire, myself.get_cell())??;
///         println!("baking on slot {}", lease.slot_id());
///         Ok(Some(lease))
///     }
/// }
///
/// let sup = Supervisor::builder().slots(1).start().await?;
/// let desk = sup.lease_desk().await?;
/// let (baker, join) = Actor::spawn(None, Baker, desk).await?;
/// baker.stop(None);
/// join.await?;
/// sup.shutdown().await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseMsg {
    /// Waits for a slot (FIFO with every other caller) for the actor given, the holder. The
    /// lease goes back once the holder has exited and the [`ActorLease`] has been dropped. A
    /// holder that exits before the grant withdraws the request; a grant whose reply cannot be
    /// delivered (the caller's `call!` timed out) goes back at once.
    Acquire(ActorCell, RpcReplyPort<Result<ActorLease, AcquireError>>),
    /// Releases the lease of that lease id now, for the holder given, and answers with the
    /// broker release's result. A lease id that is not held by that actor through this desk is
    /// refused with `LEASE_NOT_HELD`, and nothing is released.
    Release(ActorCell, u64, RpcReplyPort<Result<(), ReleaseError>>),
}

/// A slot granted through the lease desk. Keep it in the holder's state: the slot goes back
/// only after the holder has exited and this value has been dropped. It is not `Clone`.
#[derive(Debug)]
pub struct ActorLease {
    token: SlotToken,
    holder: ActorId,
    /// What the supervisor says of the lease: revoked by shutdown, or lost at the broker.
    cell: Arc<LeaseCell>,
    /// Dropped with the `ActorLease`: the desk's task sees its receiver close.
    _held: oneshot::Sender<()>,
}

impl ActorLease {
    /// The slot.
    pub fn slot_id(&self) -> u32 {
        self.token.slot_id()
    }

    /// The lease id (a fencing token for the brokers leasehold ships); what
    /// [`LeaseMsg::Release`] names.
    pub fn lease_id(&self) -> u64 {
        self.token.lease_id()
    }

    /// The whole token.
    pub fn token(&self) -> SlotToken {
        self.token
    }

    /// The actor the lease is tied to.
    pub fn holder(&self) -> ActorId {
        self.holder
    }

    /// Whether the lease has ended under its holder: the broker reported it lost (it could not
    /// be kept alive), or a shutdown released it on the holder's behalf. The slot may then
    /// already belong to someone else, and writes under [`lease_id`](Self::lease_id) may be
    /// fenced off. As [`Lease::is_lost`](crate::Lease::is_lost).
    pub fn is_lost(&self) -> bool {
        self.cell.is_ended()
    }

    /// Resolves when the lease ends under its holder (see [`is_lost`](Self::is_lost)): select
    /// on it next to the work done under the lease.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn lost(&self) {
        self.cell.ended().await;
    }
}

/// Why a [`LeaseMsg::Release`] did not release cleanly.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ReleaseError {
    /// No lease of that id is held through the desk by that actor (never granted, another
    /// actor's, or already released); nothing was released.
    NotHeld {
        /// The lease id named.
        lease_id: u64,
    },
    /// The broker release failed or timed out.
    Cleanup(CleanupError),
}

impl ReleaseError {
    /// `LEASE_NOT_HELD`, or the cleanup error's code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NotHeld { .. } => codes::LEASE_NOT_HELD,
            Self::Cleanup(err) => err.code(),
        }
    }
}

impl fmt::Display for ReleaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotHeld { lease_id } => {
                write!(
                    f,
                    "lease {lease_id} is not held by that actor through the desk"
                )
            }
            Self::Cleanup(_) => f.write_str("the release failed"),
        }
    }
}

impl std::error::Error for ReleaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NotHeld { .. } => None,
            Self::Cleanup(err) => Some(err),
        }
    }
}

/// A lease held through the desk: who holds it, and how to hand its task a release request.
struct Held {
    holder: ActorId,
    release: oneshot::Sender<RpcReplyPort<Result<(), ReleaseError>>>,
}

type HeldTable = Arc<Mutex<FxHashMap<u64, Held>>>;

pub(crate) struct Desk;

pub(crate) struct DeskState {
    /// Weak: the desk never keeps the supervisor alive (a held lease does, as an explicit
    /// lease would).
    sup: Weak<crate::supervisor::state::Inner>,
    held: HeldTable,
}

impl Actor for Desk {
    type Msg = LeaseMsg;
    type State = DeskState;
    type Arguments = Weak<crate::supervisor::state::Inner>;

    async fn pre_start(
        &self,
        _myself: ActorRef<LeaseMsg>,
        sup: Weak<crate::supervisor::state::Inner>,
    ) -> Result<DeskState, ActorProcessingErr> {
        Ok(DeskState {
            sup,
            held: HeldTable::default(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<LeaseMsg>,
        message: LeaseMsg,
        state: &mut DeskState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            LeaseMsg::Acquire(holder, reply) => match Supervisor::upgrade(&state.sup) {
                Some(sup) => drop(tokio::spawn(hold(
                    sup,
                    holder,
                    reply,
                    Arc::clone(&state.held),
                ))),
                None => {
                    let _ = reply.send(Err(AcquireError::Stopped));
                }
            },
            LeaseMsg::Release(holder, lease_id, reply) => {
                let mut held = state.held.lock();
                let entry = match held.get(&lease_id) {
                    Some(h) if h.holder == holder.get_id() => held.remove(&lease_id),
                    _ => None,
                };
                drop(held);
                let refused = match entry {
                    Some(entry) => entry.release.send(reply).err(),
                    None => Some(reply),
                };
                // The lease's task has already ended it (its holder exited meanwhile).
                if let Some(reply) = refused {
                    let _ = reply.send(Err(ReleaseError::NotHeld { lease_id }));
                }
            }
        }
        Ok(())
    }
}

impl Supervisor {
    /// The lease desk: the supervisor's message interface for actors. An actor `call!`s
    /// [`LeaseMsg::Acquire`] with its own cell for a slot tied to it: the slot goes back
    /// through the pipeline once the holder has exited and the [`ActorLease`] has been dropped,
    /// with no explicit release; [`LeaseMsg::Release`] releases it earlier. Spawned on first
    /// use; every call returns the same actor. The lease table names each desk lease's holder
    /// ([`LeaseInfo::holder`](crate::LeaseInfo::holder)).
    ///
    /// # Errors
    ///
    /// [`SupervisorStopped`] when the desk could not be spawned.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a call dropped before the desk has started leaves none behind (the next
    /// call starts it); once started, the desk is kept for every later call.
    pub async fn lease_desk(&self) -> Result<ActorRef<LeaseMsg>, SupervisorStopped> {
        let weak = Arc::downgrade(self.inner());
        self.inner()
            .desk
            .get_or_try_init(|| async move {
                Actor::spawn(None, Desk, weak)
                    .await
                    .map(|(desk, _join)| desk.get_cell())
                    .map_err(|_| SupervisorStopped::new())
            })
            .await
            .map(|cell| ActorRef::from(cell.clone()))
    }
}

/// Acquires a slot for `holder` and keeps it until the holder has exited and its
/// [`ActorLease`] is dropped, or until released by message.
async fn hold(
    sup: Supervisor,
    holder: ActorCell,
    reply: RpcReplyPort<Result<ActorLease, AcquireError>>,
    table: HeldTable,
) {
    let acquired = tokio::select! {
        biased;
        acquired = sup.acquire_for(Ask::one(Want::Lease), Some(Box::new(holder.get_id()))) => acquired,
        // The holder ended before the grant: `acquire` is cancel safe, dropping it withdraws.
        _ = holder.wait(None) => return,
    };
    // Nobody may be left to hear a release's failure: it goes to the error sink then.
    let sink = sup.sink().clone();
    drop(sup);
    let mut lease = match acquired {
        Ok(lease) => lease,
        Err(err) => {
            let _ = reply.send(Err(err));
            return;
        }
    };
    let Ok(token) = lease.token() else {
        // Ended under us already (shutdown): nothing to hand out.
        let _ = reply.send(Err(AcquireError::Stopped));
        return;
    };
    let lease_id = token.lease_id();
    let (held_tx, held_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    table.lock().insert(
        lease_id,
        Held {
            holder: holder.get_id(),
            release: release_tx,
        },
    );
    let granted = ActorLease {
        token,
        holder: holder.get_id(),
        cell: lease.cell(),
        _held: held_tx,
    };
    if reply.send(Ok(granted)).is_err() {
        // Nobody took it: the supervisor releases it (a failure reaches the error sink).
        table.lock().remove(&lease_id);
        drop(lease);
        return;
    }
    let exited = async {
        let _ = holder.wait(None).await;
        // Resolves when the `ActorLease` is dropped (its sender closes).
        let _ = held_rx.await;
    };
    tokio::select! {
        biased;
        Ok(reply) = release_rx => {
            let result = lease.release().await.map_err(ReleaseError::Cleanup);
            if let Err(ractor::MessagingErr::SendErr(Err(ReleaseError::Cleanup(cleanup)))) =
                reply.send(result)
            {
                // The caller gave up (its `call!` timed out): the failure still reaches someone
                // (invariant 7), once.
                sink.report(None, cleanup);
            }
        }
        () = exited => {
            table.lock().remove(&lease_id);
            // The holder is gone: the supervisor releases the slot through its pipeline, and a
            // failure goes to the error sink, the metric and `tracing`.
            drop(lease);
        }
    }
}
