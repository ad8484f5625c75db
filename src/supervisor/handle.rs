//! The handle: [`Supervisor`], what a caller holds. Each call turns into a message on the
//! actor's inbox, or reads what the actor published.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::Span;

use super::core::{Ask, WaiterId, Want};
use super::job_handle::JobHandle;
use super::messages::{Control, KeptSpan, PendingJob, SupMsg, WaiterKind};
use super::reports::{QuarantinedSlot, ReclaimReport, ShutdownReport, WaiterInfo};
use super::state::{Inner, Parts};
use super::stats::Stats;
use super::table::LeaseInfo;
use super::waiting::{Submitted, WaitGuard, await_reply};
use crate::actor_job::{ActorExit, ActorJobError};
use crate::error::{AcquireError, JobError, ResizeError, ShutdownError, SupervisorStopped};
use crate::job::{JobParts, JobSpec};
use crate::lease::Lease;
use crate::worker::{BoxedBody, JobShared, WorkerContext};

/// The handle to a running supervisor. `Clone + Send + Sync`; clones share one actor.
///
/// When the last handle (and the last [`Lease`]) is dropped, the supervisor shuts down on its
/// own, as [`shutdown`](Self::shutdown) would.
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use leasehold::{JobSpec, Supervisor};
///
/// let sup = Supervisor::builder().slots(2).start().await?;
/// let n = sup
///     .run(JobSpec::new("hello")?, |ctx| async move {
///         std::fs::write(ctx.temp_dir().join("out.txt"), b"hi")?;
///         Ok::<_, std::io::Error>(ctx.slot_id())
///     })
///     .await?;
/// assert!(n < 2);
/// sup.shutdown().await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
///
/// # The release pipeline
///
/// Every lease held by a job goes through these steps, in this order, whatever ended the body:
///
/// ```text
///  body ends (Ok, Err, panic, cancellation, or dropped after the cancel grace)
///    │
///    ▼
///  worker physically done — in this order:
///    • the worker actor's JoinHandle has resolved (its task and state are gone; the worker
///      unlinks from the supervisor before it ends, so no supervision event carries anything);
///      the supervisor polls the handle itself, woken when it resolves
///    • the TaskTracker is empty (every ctx.spawn / ctx.spawn_blocking has returned, and
///      every ctx.spawn_process keeper has ended: child reaped, process group proven empty);
///      when tasks outlive the body, a task of the job's own waits for them under the drain
///      timeout
///    • with .gpu(..): the GPU fence — the lease's GPU work has completed (its last
///      gpu.submit(..), or with FencePolicy::Queue and the queue taken, everything on the
///      queue up to this point; a blocking poll on tokio's blocking pool); nothing for a
///      lease with no GPU work. The slot's scratch is cleared when the next lease takes it
///    │
///    ▼
///  temp dir removed, if the job made one (it is made on first use: ctx.temp_dir(),
///  ctx.path(..), ctx.spawn_process(..)): on tokio's blocking pool, under cleanup_timeout,
///  its answer polled by the supervisor itself
///    │
///    ▼
///  broker release, bounded by cleanup_timeout (the supervisor's own timer;
///  the caller's cancellation cannot shorten it)
///    │
///    ▼
///  slot handed to the next live waiter (FIFO), or back to the free list
///    │
///    ▼
///  caller, if still waiting, gets the body result together with any cleanup error
/// ```
///
/// If the worker's end or the temp dir's removal cannot be proven (tracked tasks still running after
/// `.drain_timeout(..)`, a temp dir that cannot be removed, child processes that cannot be proven
/// gone, GPU work not completed within the fence timeout, a lost GPU device), the slot is
/// **quarantined**: not reused, counted in `stats().quarantined`, listed by
/// [`quarantined`](Self::quarantined), reported as `LEASE_CLEANUP_UNCONFIRMED`
/// (`LEASE_GPU_DEVICE_LOST` for a lost device), and never declared clean. A slot quarantined by the
/// drain timeout or the GPU fence timeout is released on its own once its tasks end (or its GPU work
/// completes) and its temp dir is removed; one quarantined for a lost GPU device, once the device
/// has been re-created or given up (see [GPU slots]). A slot quarantined for its processes or for
/// its temp dir is released only through [`reclaim_quarantined`](Self::reclaim_quarantined), which
/// checks again (see [child processes](crate::process)). An explicit [`Lease`] has no worker, no
/// temp dir and no GPU: its release goes straight to the broker step.
///
/// [`stats`](Self::stats) shows the pipeline as it runs: `active` counts the slots held and not
/// quarantined (running, draining, releasing), `draining` the jobs whose body has ended while their
/// physical end or temp dir removal is still being proven, `quarantined` the slots held in
/// quarantine.
///
/// # Shutdown
///
/// [`shutdown`](Self::shutdown) ends everything the supervisor started, whatever phase it is in
/// (invariant 8 of DESIGN.md), and never waits without bound:
///
/// 1. New work is refused and every waiter hears `SUPERVISOR_STOPPED`; broker acquires in flight
///    are aborted (a token that still arrives is released at once).
/// 2. Every job not yet released is cancelled, running or draining: its body sees
///    `ctx.cancelled()`, its process groups get `SIGTERM` and `SIGKILL` after `process_grace`, and
///    after the cancel grace its body future and the tasks it spawned through its context are
///    dropped. Explicit leases still held are released on their holders' behalf (`lost()` resolves
///    for them).
/// 3. The release pipeline runs for each as usual, bounded by `.shutdown_timeout(..)` (default
///    30 s). What is not proven done by then (a blocking closure still running, a process stuck in
///    uninterruptible sleep, GPU work that never completes, a temp dir that cannot be removed) is
///    quarantined, not waited for.
/// 4. The GPU devices are closed, each on a thread of its own and for at most the cleanup timeout.
///
/// The [`ShutdownReport`] says what happened: `refused_waiters`, `cancelled_jobs`,
/// `released_leases`, `quarantined` with the reason of each slot in `unproven`, the GPU devices that
/// could not be proven idle in `unclosed_devices`, and the final `stats`. A second `shutdown()`
/// returns the same kind of report; dropping the future does not stop the shutdown.
///
/// # What happens when
///
/// | event | the slot | the temp dir | what the caller gets |
/// |---|---|---|---|
/// | success | released after the pipeline above, then handed on | removed before the release | `Ok(T)` |
/// | body returns `Err(E)` | same pipeline | removed | `LEASE_BODY_FAILED`; `body_error().error()` is your `E` |
/// | body (or a tracked task) panics | same pipeline; the panic is caught in the worker | removed | `LEASE_BODY_PANICKED`; `body_error().panics()` has the messages |
/// | cancellation (token, or dropped `run` future) while running | released only after the body and every tracked task have ended | removed after that | `LEASE_BODY_CANCELLED` (a body that still returns `Ok` after cancellation gives `Ok`) |
/// | cancellation while waiting | nothing acquired; a grant in the same instant goes to the next waiter | none made | `LEASE_ACQUIRE_CANCELLED` |
/// | acquire timeout (`.acquire_timeout(..)`) | nothing acquired | none made | `LEASE_ACQUIRE_TIMEOUT` |
/// | the broker panics (in `acquire`, `release`, `keep_alive` or `close`, on any poll) | caught: an acquire fails and nothing is held; a release counts as failed; a renewal is a lost lease; the other slots keep serving | as for a failed release | `LEASE_ACQUIRE_FAILED` or `LEASE_CLEANUP_FAILED`, with `BrokerErrorKind::Panicked` (`BROKER_PANICKED`) |
/// | cleanup timeout (broker release slower than `cleanup_timeout`) | the release future is dropped and the lease ends, counted in `release_failed_total`; whether the broker frees the slot is up to the broker | already removed | `LEASE_CLEANUP_TIMEOUT`, or `LEASE_BODY_AND_CLEANUP_FAILED` when the body failed too |
/// | child processes when the job is cancelled (token, dropped `run` future, shutdown) | held until each group got `SIGTERM`, `SIGKILL` after `process_grace` if needed, its leader is reaped and the group proven empty | removed only after that | `LEASE_BODY_CANCELLED`, as for any cancellation |
/// | a descendant escaped its process group | if recorded at the stop (its parent alive): signalled through a pidfd and proven gone before the release. If orphaned and still alive past the proof bound: quarantined until `reclaim_quarantined()` finds it gone | kept while quarantined | `LEASE_BODY_CANCELLED` (or the body's result) once proven gone; otherwise `LEASE_CLEANUP_UNCONFIRMED` |
/// | a GPU job cancelled (or just returning) with GPU work in flight | held until the fence: its last `gpu.submit(..)` (with `FencePolicy::Queue` and the queue taken, everything on the queue before the worker ended) has completed (a blocking poll on the blocking pool, never in the supervisor's mailbox; no fence for a lease with no GPU work); only then is the sub-slot handed on (its scratch is cleared when the next lease takes it). Past `fence_timeout`: quarantined at once, released when the work completes | removed after the fence | `LEASE_BODY_CANCELLED` (or the body's result) once the work has completed; past the fence timeout, at once: `LEASE_BODY_AND_CLEANUP_FAILED` (`LEASE_CLEANUP_UNCONFIRMED` if the body succeeded) |
/// | the GPU backend panics in a call leasehold makes (fence, submission through `JobGpu`, scratch, drop of a device's last handles) | contained; counted as a loss of the device (next row) | as next row | as next row |
/// | the GPU device is lost (driver reset, `device.destroy()`) | quarantined; the device is re-created in the background (one creator, retries under `recreate_policy`); released once it is replaced, or given up; waiters continue on the new device. An adopted device waits for the engine's replacement; shutdown does not wait for it | kept until then | `LEASE_GPU_DEVICE_LOST` at once (`LEASE_BODY_AND_CLEANUP_FAILED` when the body failed too) |
/// | physical end not provable (`drain_timeout`, GPU work past `fence_timeout`, temp dir removal failed, processes not proven gone within `process_proof_bound`) | quarantined, not reused; released on its own once its tasks end (drain timeout) or its GPU work completes (fence timeout), otherwise only through `reclaim_quarantined()` | kept while quarantined | `LEASE_CLEANUP_UNCONFIRMED` (or `LEASE_BODY_AND_CLEANUP_FAILED`) |
/// | process kill, power loss, runtime crash | **out of scope**: no cleanup can run. The in-process pool dies with the process; for a distributed broker only its lease TTL recovers the slot (counted as orphan expiry) | left on disk | nothing |
///
/// The codes are listed in [`codes`](crate::error::codes).
///
/// A cleanup failure that has no caller left (a dropped [`Lease`], a dropped `run` future) goes to
/// the error sink (`.error_sink(|f: &OrphanedFailure| ..)`), the `render_slot.release.failed.count`
/// metric and a `tracing` error event. It is never swallowed. The sink is the user's code, so it
/// never runs in the supervisor's turn: failures wait in a bounded queue (1024) drained on tokio's
/// blocking pool, one call at a time. A sink that blocks or falls behind delays nobody; what does
/// not fit in its queue is counted in `render_slot.sink.dropped.count` and logged. A sink that
/// panics is caught and called again for the next failure. `shutdown()` answers once the sink has
/// had every failure, or names it in `ShutdownReport::outlived` when it is still busy at the
/// shutdown's bound.
///
/// Nothing else the user wrote runs, or is dropped, where it could stop or stall the supervisor: a
/// panic's payload is dropped under the panic catch (one whose own drop panics is leaked, not
/// dropped again), and a job's closure or actor that never ran (refused, cancelled while queued, its
/// caller gone at the hand-over) is dropped on the blocking pool. At shutdown the broker, the
/// closures of jobs still queued and the work root's removal are dropped off the supervisor's task,
/// within the shutdown's bound; what is still being dropped then is named in
/// `ShutdownReport::outlived`.
///
/// [GPU slots]: https://github.com/leasehold-rs/leasehold/blob/main/docs/gpu.md
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl Supervisor {
    pub(super) fn from_parts(parts: Parts) -> Self {
        let Parts {
            inbox,
            join,
            stats,
            table,
            last_report,
            acquire_timeout,
            cancel_grace,
            shutdown_timeout,
            resizable,
            work_root,
            sink,
            #[cfg(feature = "gpu")]
            gpu,
        } = parts;
        Self {
            inner: Arc::new(Inner {
                inbox,
                join: Mutex::new(Some(join)),
                stats,
                table,
                last_report,
                acquire_timeout,
                shutdown_timeout,
                next_waiter: AtomicU64::new(1),
                work_root,
                runtime: tokio::runtime::Handle::current(),
                sink,
                cancel_grace,
                resizable,
                desk: tokio::sync::OnceCell::new(),
                #[cfg(feature = "gpu")]
                gpu,
            }),
        }
    }

    /// A handle from the desk's weak reference, while any other handle lives.
    pub(crate) fn upgrade(inner: &std::sync::Weak<Inner>) -> Option<Self> {
        inner.upgrade().map(|inner| Self { inner })
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// Where a cleanup failure with nobody left to hear it goes.
    pub(crate) fn sink(&self) -> &crate::sink::Sink {
        &self.inner.sink
    }

    /// A cheap snapshot of the counters (atomics; no message to the actor).
    pub fn stats(&self) -> Stats {
        self.inner.stats.snapshot()
    }

    /// The directory under which job temp dirs are made.
    pub fn work_root(&self) -> &Path {
        &self.inner.work_root
    }

    fn next_waiter(&self) -> WaiterId {
        // Relaxed: only uniqueness matters.
        WaiterId(self.inner.next_waiter.fetch_add(1, Ordering::Relaxed))
    }

    /// Waits for a slot (FIFO) and returns it as an explicit [`Lease`].
    ///
    /// # Errors
    ///
    /// [`AcquireError`]: `LEASE_ACQUIRE_TIMEOUT` after the configured acquire timeout,
    /// `LEASE_ACQUIRE_FAILED` when the broker failed, `SUPERVISOR_STOPPED` after shutdown.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe. Dropping the future withdraws the request; a slot granted in the same
    /// instant is released by the supervisor (or goes to the next waiter), never leaked.
    pub async fn acquire(&self) -> Result<Lease, AcquireError> {
        self.acquire_for(Ask::one(Want::Lease), None).await
    }

    /// Waits for `slots` slots at once and returns them as one explicit [`Lease`] (all or none):
    /// FIFO with head-of-line blocking, as tokio's `Semaphore::acquire_many`: once this request
    /// is at the head of the queue, the slots freed go to it until it has them all, and the
    /// callers behind it wait. The lease's [`tokens`](Lease::tokens) lists them; its release
    /// gives them all back.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire), and: `LEASE_SLOT_COUNT_INVALID` for 0 slots or more than
    /// the capacity (also when a [`resize`](Self::resize) lowers the capacity below it while
    /// it waits); `LEASE_BROKER_UNSUPPORTED` for more than one slot from a broker other than
    /// the supervisor's in-process pool (several supervisors gathering slots from one shared
    /// broker could each hold part of what the other needs, for ever).
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::Supervisor;
    ///
    /// let sup = Supervisor::builder().slots(4).start().await?;
    /// let mut lease = sup.acquire_many(3).await?;
    /// assert_eq!(lease.tokens()?.len(), 3);
    /// assert_eq!(sup.stats().held_slots, 3);
    /// lease.release().await?;
    /// assert_eq!(sup.acquire_many(5).await.unwrap_err().code(), "LEASE_SLOT_COUNT_INVALID");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`acquire`](Self::acquire): the slots gathered so far go on to the next
    /// waiters.
    pub async fn acquire_many(&self, slots: u32) -> Result<Lease, AcquireError> {
        self.acquire_for(
            Ask {
                slots,
                ..Ask::one(Want::Lease)
            },
            None,
        )
        .await
    }

    /// Takes a slot only if one is free now and nobody waits ahead: never waits for a slot.
    /// The answer is one round trip to the supervisor.
    ///
    /// # Errors
    ///
    /// `LEASE_NO_SLOT_FREE` when every slot is held (or callers wait ahead);
    /// `LEASE_BROKER_UNSUPPORTED` on a broker other than the supervisor's in-process pool (a
    /// remote broker cannot say whether a slot is free without queueing for it);
    /// `SUPERVISOR_STOPPED` after shutdown.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::Supervisor;
    ///
    /// let sup = Supervisor::builder().slots(1).start().await?;
    /// let held = sup.try_acquire().await?;
    /// assert_eq!(sup.try_acquire().await.unwrap_err().code(), "LEASE_NO_SLOT_FREE");
    /// drop(held);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`acquire`](Self::acquire).
    pub async fn try_acquire(&self) -> Result<Lease, AcquireError> {
        self.acquire_for(
            Ask {
                now_only: true,
                ..Ask::one(Want::Lease)
            },
            None,
        )
        .await
    }

    /// An acquire, tied to the actor `holder` when it is the lease desk's.
    pub(crate) async fn acquire_for(
        &self,
        ask: Ask,
        holder: Option<Box<ractor::ActorId>>,
    ) -> Result<Lease, AcquireError> {
        let waiter = self.next_waiter();
        let (tx, mut rx) = oneshot::channel();
        let msg = SupMsg::Acquire {
            waiter,
            kind: WaiterKind::Lease {
                reply: tx,
                span: KeptSpan::new(Span::current()),
                holder,
            },
            ask,
        };
        if self.inner.inbox.send(msg).is_err() {
            return Err(AcquireError::Stopped);
        }
        let mut guard = WaitGuard::new(&self.inner.inbox, waiter, None);
        let reply = await_reply(
            &self.inner.inbox,
            waiter,
            &mut rx,
            None,
            self.inner.acquire_timeout,
        )
        .await;
        guard.disarm();
        match reply {
            Ok(Ok(mut lease)) => {
                lease.keep_alive(Arc::clone(&self.inner) as Arc<dyn std::any::Any + Send + Sync>);
                Ok(lease)
            }
            Ok(Err(err)) => Err(err),
            Err(_) => Err(AcquireError::Stopped),
        }
    }

    /// Runs `body` under a slot, as a worker actor linked to the supervisor, and returns only
    /// after the whole release pipeline has finished: the body ended, the worker and every task
    /// it spawned through its context physically ended, its temp dir removed, the broker release
    /// awaited under the cleanup timeout, the slot handed on.
    ///
    /// A job whose token is already cancelled acquires nothing and ends
    /// `LEASE_ACQUIRE_CANCELLED`.
    ///
    /// # Errors
    ///
    /// [`JobError`], whose [`code`](JobError::code) is one of the contract's stable codes; when
    /// both the body and the cleanup failed, both are kept.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future cancels the job cooperatively (the body's
    /// [`cancelled`](WorkerContext::cancelled) resolves; after the cancel grace its future is
    /// dropped). The supervisor still completes every step of the release pipeline on its own;
    /// a cleanup failure nobody hears goes to the error sink.
    pub async fn run<F, Fut, T, E>(&self, job: JobSpec, body: F) -> Result<T, JobError<E>>
    where
        F: FnOnce(WorkerContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Send + 'static,
    {
        let mut job = match self.enqueue(job, body) {
            Ok(job) => job,
            Err(ended) => return Err(ended),
        };
        let mut guard = WaitGuard::new(&self.inner.inbox, job.waiter, Some(job.cancel.clone()));
        let outcome = await_reply(
            &self.inner.inbox,
            job.waiter,
            &mut job.answer,
            Some(&job.cancel),
            self.inner.acquire_timeout,
        )
        .await;
        guard.disarm();
        job.conclude(outcome.map_err(drop))
    }

    /// Puts a job in the supervisor's queue (one message; it is there when this returns), or
    /// says why it ended at once (its token was already cancelled, the supervisor has stopped).
    fn enqueue<F, Fut, T, E>(&self, job: JobSpec, body: F) -> Result<Submitted<T, E>, JobError<E>>
    where
        F: FnOnce(WorkerContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Send + 'static,
    {
        let JobParts {
            id: job_id,
            cancel: caller_token,
            priority,
            slots,
        } = job.into_parts();
        // A child token: cancelling the job (drop, shutdown) never cancels the caller's token.
        let cancel = caller_token.map_or_else(CancellationToken::new, |t| t.child_token());
        if cancel.is_cancelled() {
            return Err(JobError::Acquire(AcquireError::Cancelled));
        }
        let shared = Arc::new(JobShared::new(cancel.clone()));
        let (body_tx, body_rx) = oneshot::channel::<Result<T, E>>();
        let boxed: BoxedBody = Box::new(move |ctx| {
            let fut = body(ctx);
            Box::pin(async move {
                let _ = body_tx.send(fut.await);
            })
        });
        let span = tracing::info_span!(
            "leasehold.job",
            job_id = %job_id,
            slot_id = tracing::field::Empty,
            lease_id = tracing::field::Empty,
        );
        let waiter = self.next_waiter();
        let (tx, rx) = oneshot::channel();
        let deadline = self
            .inner
            .acquire_timeout
            .map(|t| tokio::time::Instant::now() + t);
        let pending = PendingJob {
            job_id: Arc::from(job_id),
            shared: Arc::clone(&shared),
            body: boxed,
            reply: tx,
            span: KeptSpan::new(span),
            deadline,
        };
        let msg = SupMsg::Acquire {
            waiter,
            kind: WaiterKind::Job(Box::new(pending)),
            ask: Ask {
                want: Want::Job,
                slots,
                priority,
                now_only: false,
            },
        };
        if let Err(refused) = self.inner.inbox.send(msg) {
            // The job's closure is the caller's: it goes back with the message, dropped here,
            // on the caller's thread.
            drop(refused);
            return Err(JobError::Acquire(AcquireError::Stopped));
        }
        Ok(Submitted {
            sup: self.inner.clone(),
            waiter,
            answer: rx,
            shared,
            body: body_rx,
            cancel,
            deadline,
        })
    }

    /// Hands the supervisor a replacement for the adopted GPU device `index` (see
    /// [`GpuOptions::adopt`](crate::GpuOptions::adopt)), typically after it was lost: the new
    /// device and queue become its next generation (new scratch, zeroed), its slots quarantined
    /// with `LEASE_GPU_DEVICE_LOST` come back, and jobs are placed on it again. A replacement
    /// of a device that was not lost is allowed too: leases already on it keep the old handles,
    /// are fenced there and end as usual. The new device's adapter is its own. A refused device
    /// is left as it came. When the call answers, the supervisor has taken the replacement in:
    /// [`stats`](Self::stats) and [`leases`](Self::leases) show the slots back.
    ///
    /// # Errors
    ///
    /// [`GpuError::ReplaceRefused`](crate::GpuError::ReplaceRefused) (code `GPU_REPLACE_REFUSED`): no GPU, no device `index`, a
    /// device leasehold opened itself (it re-creates those on its own), or a supervisor that has
    /// shut down. [`GpuError::CreateFailed`](crate::GpuError::CreateFailed) when the new device refused the scratch buffers;
    /// nothing was installed then.
    ///
    /// # Cancel safety
    ///
    /// The replacement is installed before the first await: dropping the future only stops
    /// the wait for the supervisor to take it in, which it does anyway.
    #[cfg(feature = "gpu")]
    pub async fn replace_device(
        &self,
        index: usize,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Result<(), crate::gpu::GpuError> {
        let pool = self.inner.gpu.as_ref().ok_or_else(|| {
            crate::gpu::GpuError::ReplaceRefused("the supervisor has no gpu devices".into())
        })?;
        pool.replace(index, device, queue)?;
        // The replacement reached the supervisor's inbox (first in, first out) inside
        // `replace`: any call answered after it has been taken in, and answers leave only
        // after the turn's effects are published.
        let _ = self.waiters().await;
        Ok(())
    }

    /// Whether [`resize`](Self::resize) can change this supervisor's size: its slots come from
    /// the in-process pool (`.slots(n)`, or a [`LocalBroker`](crate::LocalBroker) given to
    /// `.broker(..)`). Another broker decides its own capacity, and `resize` answers
    /// `LEASE_BROKER_UNSUPPORTED` there. Fixed for the supervisor's life.
    pub fn can_resize(&self) -> bool {
        self.inner.resizable
    }

    /// The supervisor's GPU devices (feature `gpu`; none without it, or without `.gpu(..)`):
    /// per device its adapter, whether the engine handed it over, its sub-slots in use, how
    /// often it has been created, and its loss. A synchronous snapshot of the pool's own
    /// bookkeeping: no message to the actor, cheap enough for every frame of a UI.
    pub fn gpu_devices(&self) -> Vec<crate::gpu_info::GpuDeviceInfo> {
        #[cfg(feature = "gpu")]
        if let Some(pool) = &self.inner.gpu {
            return pool.describe();
        }
        Vec::new()
    }

    /// The supervisor's GPU device of that index (features `gpu` and `fault-injection`), of its
    /// current generation: for leasehold's own fault-injection tests (`device.destroy()` simulates a device loss). After a
    /// loss this is still the lost device until its replacement is installed (watch
    /// [`gpu_device_generation`](Self::gpu_device_generation)); `None` for an index the
    /// supervisor does not have.
    #[cfg(all(feature = "gpu", feature = "fault-injection"))]
    #[doc(hidden)]
    pub fn gpu_device(&self, index: usize) -> Option<wgpu::Device> {
        self.inner.gpu.as_ref()?.device(index)
    }

    /// How many times the GPU device of that index has been created (feature `gpu`): 1 at
    /// start, one more per re-creation after a loss.
    #[cfg(all(feature = "gpu", feature = "fault-injection"))]
    #[doc(hidden)]
    pub fn gpu_device_generation(&self, index: usize) -> Option<u64> {
        self.inner.gpu.as_ref()?.generation(index)
    }

    /// How many GPU devices the supervisor owns (features `gpu` and `fault-injection`).
    #[cfg(all(feature = "gpu", feature = "fault-injection"))]
    #[doc(hidden)]
    pub fn gpu_device_count(&self) -> usize {
        self.inner.gpu.as_ref().map_or(0, |g| g.device_count())
    }

    /// Every lease held now, by slot: its job, slot, phase, how long it has been held, what its
    /// release still waits for, its GPU device and child processes. A snapshot of a table the
    /// supervisor keeps up to date after each batch of messages: no message to the actor, cheap
    /// enough for a debug overlay every frame (one short lock per shard of a concurrent map).
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::{LeaseKind, LeasePhase, Supervisor};
    ///
    /// let sup = Supervisor::builder().slots(2).start().await?;
    /// let lease = sup.acquire().await?;
    /// let table = sup.leases();
    /// assert_eq!(table.len(), 1);
    /// assert_eq!(table[0].kind, LeaseKind::Explicit);
    /// assert_eq!(table[0].phase, LeasePhase::Running);
    /// assert_eq!(table[0].slot_id, lease.slot_id()?);
    /// drop(lease);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn leases(&self) -> Vec<LeaseInfo> {
        self.inner.table.snapshot()
    }

    /// Cancels every job with this id that waits for a slot or holds one (running, or draining
    /// its tracked tasks and processes): `true` when there was one. Cancelling is a request,
    /// as with the job's own token: a waiting job leaves the queue (`LEASE_ACQUIRE_CANCELLED`);
    /// a running one sees [`WorkerContext::cancelled`] resolve, and its slot returns only
    /// through the release pipeline, once the worker has physically finished. A job whose
    /// release has begun is not counted.
    ///
    /// Once it answers, [`stats`](Self::stats) and [`leases`](Self::leases) show its effect
    /// (a waiting job is no longer counted in `waiting`).
    ///
    /// # Errors
    ///
    /// [`SupervisorStopped`] (code `SUPERVISOR_STOPPED`) when the supervisor is gone.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after the message is sent does not undo the cancellation.
    pub async fn cancel(&self, job_id: &str) -> Result<bool, SupervisorStopped> {
        self.ask(|reply| Control::Cancel {
            job_id: job_id.into(),
            reply,
        })
        .await
    }

    /// Sets the capacity of the supervisor's in-process pool, live: raising it wakes waiters at
    /// once; lowering it never revokes a held lease, it takes effect as leases return (and a
    /// waiting multi-slot request larger than the new capacity is refused with
    /// `LEASE_SLOT_COUNT_INVALID`). Returns the capacity now in force: `slots`, capped by the
    /// GPU sub-slots when the supervisor owns GPU devices. [`Stats::capacity`] shows it as soon
    /// as this answers. Slots above a lowered size are retired as they come back: no request,
    /// however it gathered them, is handed a slot above the capacity in force.
    ///
    /// # Errors
    ///
    /// [`ResizeError`]: 0 slots (`LEASE_SLOT_COUNT_INVALID`), a broker other than the in-process
    /// pool (`LEASE_BROKER_UNSUPPORTED`), a supervisor that has shut down
    /// (`SUPERVISOR_STOPPED`).
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::Supervisor;
    ///
    /// let sup = Supervisor::builder().slots(1).start().await?;
    /// let first = sup.acquire().await?;
    /// sup.resize(2).await?;
    /// let second = sup.try_acquire().await?; // the new slot is free at once
    /// assert_eq!(sup.stats().capacity, Some(2));
    /// drop((first, second));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after the message is sent does not undo the resize.
    pub async fn resize(&self, slots: u32) -> Result<u32, ResizeError> {
        self.ask(|reply| Control::Resize { slots, reply })
            .await
            .map_err(|_| ResizeError::Stopped)?
    }

    /// The quarantined slots, one entry per slot (a quarantined k-slot lease lists k), with
    /// the reason each could not be declared clean.
    ///
    /// # Errors
    ///
    /// [`SupervisorStopped`] (code `SUPERVISOR_STOPPED`) when the supervisor is gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn quarantined(&self) -> Result<Vec<QuarantinedSlot>, SupervisorStopped> {
        self.ask(|reply| Control::Quarantined { reply }).await
    }

    /// Checks every quarantined slot again: process groups proven empty now (and escaped
    /// descendants proven gone), temp dirs that can be removed now. Those slots continue
    /// through the pipeline (temp dir removal, broker release) and are handed on; the others
    /// stay quarantined. It answers once every removal it retried has ended, so a slot is
    /// reported reclaimed only when its temp dir is gone (bounded by the cleanup timeout: a
    /// removal still running then is reported still quarantined). A slot quarantined by the
    /// drain timeout needs no call: it is released as soon as its tasks end.
    ///
    /// # Errors
    ///
    /// [`SupervisorStopped`] (code `SUPERVISOR_STOPPED`) when the supervisor is gone.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not undo the check: slots found clean are released anyway.
    pub async fn reclaim_quarantined(&self) -> Result<ReclaimReport, SupervisorStopped> {
        self.ask(|reply| Control::Reclaim { reply }).await
    }

    /// The callers waiting for slots, in the order they are served: a `try_acquire` being
    /// answered, the multi-slot request gathering at the head of the queue, then the queue by
    /// the aging rule (see [`Priority`](crate::Priority)). One message to the actor: a tool that
    /// polls it should do so about once a second, and only while [`Stats::waiting`] is not zero.
    ///
    /// # Errors
    ///
    /// [`SupervisorStopped`] (code `SUPERVISOR_STOPPED`) when the supervisor is gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn waiters(&self) -> Result<Vec<WaiterInfo>, SupervisorStopped> {
        self.ask(|reply| Control::Waiters { reply }).await
    }

    /// One control call to the actor and its answer, sent once its effect is visible; an
    /// unreachable actor is `SUPERVISOR_STOPPED`.
    async fn ask<R>(
        &self,
        control: impl FnOnce(oneshot::Sender<R>) -> Control,
    ) -> Result<R, SupervisorStopped> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .inbox
            .send(SupMsg::Control(control(tx)))
            .map_err(|_| SupervisorStopped::new())?;
        rx.await.map_err(|_| SupervisorStopped::new())
    }

    /// Submits a job without waiting: for game and render loops that cannot `.await`. The job
    /// runs exactly as with [`run`](Self::run), on the runtime the supervisor was started on;
    /// the returned [`JobHandle`] is polled without blocking (`is_finished`, `try_take`) and can
    /// cancel the job. Callable from any thread, inside or outside a runtime.
    ///
    /// The job is in the supervisor's queue when this returns (one message; no task is spawned
    /// for it): jobs submitted one after another are served in that order within a priority
    /// class, and a [`cancel`](Self::cancel) sent afterwards finds it.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{JobSpec, Supervisor};
    ///
    /// let rt = tokio::runtime::Runtime::new()?;
    /// let sup = rt.block_on(Supervisor::builder().slots(1).start())?;
    /// let mut bake = sup.submit(JobSpec::new("bake-0")?, |_ctx| async { Ok::<_, std::io::Error>(42) });
    /// let value = loop {
    ///     // once per frame
    ///     if let Some(result) = bake.try_take() {
    ///         break result?;
    ///     }
    ///     std::thread::yield_now();
    /// };
    /// assert_eq!(value, 42);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn submit<F, Fut, T, E>(&self, job: JobSpec, body: F) -> JobHandle<T, E>
    where
        F: FnOnce(WorkerContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Send + 'static,
    {
        let job_id = job.id().to_owned();
        let sink = self.inner.sink.clone();
        match self.enqueue(job, body) {
            Ok(job) => JobHandle::submitted(job_id, job.cancel.clone(), sink, job),
            Err(ended) => JobHandle::ended(job_id, CancellationToken::new(), sink, Err(ended)),
        }
    }

    /// Spawns `actor` as a job. The job is queued when this returns, before its future is
    /// first polled (as with [`submit`](Self::submit)); the future waits for a slot (FIFO in
    /// the one queue shared with `run`,
    /// cancellable, with the job's priority and slot count), makes the job's temp dir (and
    /// checks out its GPU), calls `args` with the job's [`WorkerContext`] (slot, token, temp
    /// dir, tracked `spawn` / `spawn_blocking`, child processes, GPU) to build the actor's
    /// arguments, then spawns the actor in the supervision tree supervisor → the job's worker →
    /// a per-job watch → the actor. It answers once the actor has started, with its `ActorRef`
    /// and a [`JobHandle`] for the outcome.
    ///
    /// The slot goes through the same release pipeline as any job's: released only after the
    /// actor's task has ended and its state has been dropped (also when a panic's
    /// `ActorFailed` arrives first, and when a normal stop moves the state into its supervision
    /// event), after every task and process it started through the context has ended, its GPU
    /// work has completed and its temp dir is gone.
    ///
    /// Outcomes: the actor stopped on its own is a success ([`ActorExit`], with the stop
    /// reason); a panic in any callback is `LEASE_BODY_PANICKED` with the message; a callback's
    /// error is `LEASE_BODY_FAILED`; cancellation (the job's token, [`cancel`](Self::cancel),
    /// dropping the handle, shutdown) stops the actor with [`CANCEL_STOP_REASON`], kills it if
    /// it is still running a cancel grace later, and ends `LEASE_BODY_CANCELLED`. Cleanup
    /// failures reach the handle, or the error sink once it is dropped or detached.
    ///
    /// Actors the job actor spawns itself are not part of its lease: link them to it and stop
    /// them in its `post_stop`, or give each its own job.
    ///
    /// [`CANCEL_STOP_REASON`]: crate::CANCEL_STOP_REASON
    ///
    /// # Errors
    ///
    /// The job's [`JobError`] when the actor never started: no slot (an acquire code, or
    /// `SUPERVISOR_STOPPED`; `LEASE_ACQUIRE_TIMEOUT` once the acquire timeout passes, and
    /// `LEASE_ACQUIRE_CANCELLED` once the job's token is cancelled, while the future waits),
    /// or its arguments closure or `pre_start` failed
    /// (`LEASE_BODY_FAILED`, or `LEASE_BODY_PANICKED` for a panic, with
    /// [`ActorJobError::StartFailed`]), returned after its slot has gone through the pipeline.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future cancels the job, as dropping its [`JobHandle`] would: a waiting job
    /// withdraws, a started actor is stopped, and the pipeline completes on its own.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::{JobSpec, Supervisor, WorkerContext};
    /// use ractor::{Actor, ActorProcessingErr, ActorRef};
    ///
    /// struct Loader;
    ///
    /// impl Actor for Loader {
    ///     type Msg = String;
    ///     type State = WorkerContext;
    ///     type Arguments = WorkerContext;
    ///
    ///     async fn pre_start(
    ///         &self,
    ///         _myself: ActorRef<String>,
    ///         ctx: WorkerContext,
    ///     ) -> Result<WorkerContext, ActorProcessingErr> {
    ///         Ok(ctx)
    ///     }
    ///
    ///     async fn handle(
    ///         &self,
    ///         myself: ActorRef<String>,
    ///         asset: String,
    ///         ctx: &mut WorkerContext,
    ///     ) -> Result<(), ActorProcessingErr> {
    ///         std::fs::write(ctx.temp_dir().join("asset"), asset)?;
    ///         myself.stop(Some("loaded".into()));
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let sup = Supervisor::builder().slots(2).start().await?;
    /// let (loader, outcome) = sup
    ///     .spawn_job(JobSpec::new("load-0")?, Loader, |ctx| ctx)
    ///     .await?;
    /// loader.cast("rock.mesh".to_owned())?;
    /// let exit = outcome.join().await?;
    /// assert_eq!(exit.reason(), Some("loaded"));
    /// sup.shutdown().await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn spawn_job<A, F>(
        &self,
        job: JobSpec,
        actor: A,
        args: F,
    ) -> impl Future<Output = SpawnedJob<A>> + Send + use<A, F>
    where
        A: ractor::Actor,
        F: FnOnce(WorkerContext) -> A::Arguments + Send + 'static,
    {
        let (started_tx, started_rx) = oneshot::channel();
        let grace = self.inner.cancel_grace;
        // Queued now, before the future is first polled: submission order is queue order.
        let handle = self.submit(job, move |ctx| {
            crate::actor_job::host(actor, args, started_tx, grace, ctx)
        });
        async move {
            // Nobody polls the handle while the actor is awaited: a cancellation or the acquire
            // timeout withdraws the job here, and the start is still awaited (a grant made before
            // the deadline that won the race is never lost; a job refused drops its closure, and
            // `started_tx` with it).
            let mut started_rx = started_rx;
            let started = tokio::select! {
                biased;
                started = &mut started_rx => started,
                () = handle.withdraw_when_due() => started_rx.await,
            };
            match started {
                Ok(actor) => Ok((actor, handle)),
                // The actor never started: the job's result says why, after its pipeline.
                Err(_) => match handle.join().await {
                    Err(err) => Err(err),
                    // Unreachable: the body answers `Ok` only after it has sent the actor.
                    Ok(_) => Err(JobError::Acquire(AcquireError::Stopped)),
                },
            }
        }
    }

    /// Refuses new work, fails every waiter with `SUPERVISOR_STOPPED`, cancels every job not yet
    /// released whatever its phase (stopping its process groups, aborting its tracked tasks
    /// after the cancel grace), releases explicit leases still held, waits for the release
    /// pipelines, then stops the actor. Nothing is waited for beyond the shutdown timeout
    /// ([`SupervisorBuilder::shutdown_timeout`]): a slot whose quarantine would clear on its own
    /// (late tasks, GPU work, a device being re-created) is waited for until then; one that only
    /// a re-check could clear (processes not proven gone, a temp dir not removed) is reported at
    /// once. A later call returns the same report.
    ///
    /// # Errors
    ///
    /// [`ShutdownError`] when the supervisor was unreachable without having shut down (its
    /// runtime is gone, or it died).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not stop the shutdown, which continues on its own.
    ///
    /// [`SupervisorBuilder::shutdown_timeout`]: crate::SupervisorBuilder::shutdown_timeout
    pub async fn shutdown(&self) -> Result<ShutdownReport, ShutdownError> {
        let started = tokio::time::Instant::now();
        let (tx, rx) = oneshot::channel();
        let sent = self
            .inner
            .inbox
            .send(SupMsg::Shutdown { reply: Some(tx) })
            .is_ok();
        let report = if sent { rx.await.ok() } else { None };
        // Wait for the actor's task itself, and for what it drops at its end (the broker, the
        // closures of jobs that never ran, its own work root), so that they are gone when this
        // returns: within the shutdown's bound, and no longer. What outlives it is named.
        let deadline =
            (started + self.inner.shutdown_timeout).max(tokio::time::Instant::now() + END_GRACE);
        let mut outlived = Vec::new();
        let join = self.inner.join.lock().take();
        if let Some(mut join) = join
            && tokio::time::timeout_at(deadline, &mut join).await.is_err()
        {
            outlived.push("the supervisor's task".to_owned());
            // Not waited for again: a later call answers at once.
            drop(join);
        }
        outlived.extend(self.inner.last_report.drops.wait_until(deadline).await);
        // Every failure nobody heard has reached the error sink, unless the sink is stuck.
        if !self.inner.sink.drained_until(deadline).await {
            outlived.push("the error sink".to_owned());
        }
        match report.or_else(|| self.inner.last_report.get()) {
            Some(mut report) => {
                report.outlived = outlived;
                Ok(report)
            }
            None => Err(ShutdownError::new()),
        }
    }
}

impl fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Supervisor")
            .field("work_root", &self.inner.work_root)
            .field("stats", &self.stats())
            .finish()
    }
}

/// What [`Supervisor::spawn_job`] answers: the job actor and the handle of its outcome, or why
/// it never started.
pub type SpawnedJob<A> = Result<
    (
        ractor::ActorRef<<A as ractor::Actor>::Msg>,
        JobHandle<ActorExit, ActorJobError>,
    ),
    JobError<ActorJobError>,
>;

/// How long `shutdown` waits, at least, for the supervisor's task and its end's drops once the
/// report is in (when the shutdown's own bound has already run out).
const END_GRACE: Duration = Duration::from_millis(100);

// The handle and the futures of public async fns are `Send` (and the handle `Sync`).
const _: fn() = || {
    fn send_sync<T: Send + Sync + Clone>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<Supervisor>();
    let sup: &Supervisor = todo_ref();
    send(&sup.acquire());
    send(&sup.shutdown());
    send(&sup.run(JobSpec::new("x").unwrap(), |_ctx| async {
        Ok::<(), std::io::Error>(())
    }));
};

#[allow(clippy::needless_lifetimes)]
fn todo_ref<'a, T>() -> &'a T {
    unreachable!("only used in a never-called type assertion")
}
