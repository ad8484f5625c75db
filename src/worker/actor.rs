//! The worker actor: checks out the job's GPU, then runs the body in its own task, under the
//! job's span, with the cancel-then-grace rule. The job's temp dir is made on first use, by
//! the context.

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef};
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use super::context::ContextParts;
use super::{JobReports, JobShared, WorkerContext};
use crate::broker::SlotToken;
use crate::hosts::Hosts;
use crate::process::ProcessPolicy;

/// The type-erased body: called once, inside the worker, with its context.
pub(crate) type BoxedBody = Box<dyn FnOnce(WorkerContext) -> BoxFuture<'static, ()> + Send>;

pub(crate) struct WorkerActor;

/// Everything a worker needs; moved into its task and dropped there, before it stops, so
/// nothing of the job travels inside its supervision event.
pub(crate) struct WorkerArgs {
    pub(crate) body: BoxedBody,
    pub(crate) token: SlotToken,
    /// The other tokens of a multi-slot job (empty: no allocation).
    pub(crate) more_tokens: Box<[SlotToken]>,
    pub(crate) job_id: Arc<str>,
    pub(crate) work_root: Arc<PathBuf>,
    pub(crate) shared: Arc<JobShared>,
    pub(crate) tracker: TaskTracker,
    pub(crate) span: Span,
    pub(crate) policy: ProcessPolicy,
    pub(crate) grace: Duration,
    pub(crate) hosts: Hosts,
    pub(crate) reporter: Arc<dyn JobReports>,
    /// Where the lease's GPU work runs (checked out before the body).
    #[cfg(feature = "gpu")]
    pub(crate) gpu: Option<crate::gpu::Placement>,
}

/// Empty once the body has run: the worker's state carries nothing of the job.
pub(crate) struct WorkerState {
    args: Option<Box<WorkerArgs>>,
}

impl Actor for WorkerActor {
    type Msg = ();
    type State = WorkerState;
    /// Boxed: ractor moves the arguments through several futures on the way into the
    /// worker's task, and a pointer is cheaper to move than the job's whole kit.
    type Arguments = Box<WorkerArgs>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: Box<WorkerArgs>,
    ) -> Result<WorkerState, ActorProcessingErr> {
        // The real spawn only moves the arguments; a scripted one may fail or take longer.
        if let Some(spawns) = &args.hosts.spawns {
            spawns.starting(&args.job_id).await?;
        }
        Ok(WorkerState { args: Some(args) })
    }

    async fn post_start(
        &self,
        myself: ActorRef<()>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(args) = state.args.take() {
            let span = args.span.clone();
            crate::counters::polled(run_job(*args, myself.get_cell()))
                .instrument(span)
                .await;
        }
        // The body (and everything it owned) has been dropped inside this task. The worker was
        // linked to the supervisor while the body ran (a supervisor that dies takes it along);
        // it unlinks now, before ractor would send the supervisor `ActorStarted` (after this
        // callback) and `ActorTerminated`: neither carries anything of the job, and the job's
        // driver proves the worker's end from its join handle. The supervisor hears one report
        // per job's end, not three.
        let cell = myself.get_cell();
        if let Some(supervisor) = cell.try_get_supervisor() {
            cell.unlink(supervisor);
        }
        myself.stop(None);
        Ok(())
    }
}

/// Prepares the job (its GPU) and runs its body; every failure is recorded in
/// `JobShared`, never propagated (the worker always ends normally).
async fn run_job(args: WorkerArgs, worker: ActorCell) {
    let WorkerArgs {
        body,
        token,
        more_tokens,
        job_id,
        work_root,
        shared,
        tracker,
        span,
        policy,
        grace,
        hosts,
        reporter,
        #[cfg(feature = "gpu")]
        gpu,
    } = args;
    // The temp dir is made on the body's first use of it, in the body's task: a slow or hung
    // file system holds this job, never the supervisor's mailbox.
    let ctx = WorkerContext::new(ContextParts {
        token,
        more_tokens,
        job_id,
        work_root,
        temp_dirs: Arc::clone(&hosts.temp_dirs),
        shared: Arc::clone(&shared),
        tracker,
        span,
        process_policy: policy,
        processes: hosts.processes.clone(),
        reporter,
        worker,
    });
    #[cfg(feature = "gpu")]
    if let (Some(placement), Some(host)) = (gpu, &hosts.gpu) {
        // May re-create a lost device (one creator, with backoff), or wait for the engine's
        // replacement of a lost adopted one: in the worker, never in the supervisor's mailbox,
        // and ended by the job's cancel.
        let checkout = tokio::select! {
            biased;
            checkout = host.checkout(placement) => checkout,
            () = ctx.cancelled() => Err(crate::gpu::GpuError::DeviceLost(
                "the job was cancelled while its gpu device was not usable (being re-created, \
                 or awaiting the engine's replacement)"
                    .into(),
            )),
        };
        match checkout {
            Ok(job_gpu) => {
                if let Some(job_gpu) = job_gpu {
                    ctx.set_gpu(job_gpu.clone());
                    shared.set_gpu(job_gpu);
                }
            }
            Err(err) => {
                tracing::error!(error = %err, "the slot's gpu device is unavailable; the body does not run");
                ctx.reporter()
                    .unprepared(crate::error::PrepareError::Gpu(err));
                return;
            }
        }
    }
    shared.mark_started();
    run_body(body, ctx, &shared, grace).await;
}

/// Runs the body until it ends, or until `grace` after the job was cancelled, whichever is
/// first; a panic is recorded, never propagated.
async fn run_body(body: BoxedBody, ctx: WorkerContext, shared: &JobShared, grace: Duration) {
    // Calling the closure runs user code: it happens here, in the worker, never in the
    // supervisor's mailbox.
    let call = std::panic::catch_unwind(AssertUnwindSafe(move || body(ctx)));
    let fut = match call {
        Ok(fut) => fut,
        Err(payload) => {
            shared.record_caught(payload);
            return;
        }
    };
    let body = AssertUnwindSafe(fut).catch_unwind();
    let grace_over = async {
        shared.cancel.cancelled().await;
        tokio::time::sleep(grace).await;
        if shared.stops_itself() {
            // A job actor's host: it kills the actor at the grace and waits for its end.
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        biased;
        result = body => {
            if let Err(payload) = result {
                shared.record_caught(payload);
            }
        }
        () = grace_over => {
            tracing::warn!(?grace, "job ignored cancellation past its grace period; its body future was dropped");
        }
    }
}
