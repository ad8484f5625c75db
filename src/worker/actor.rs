//! The worker actor: runs the body in its own task, under the job's span, with the
//! cancel-then-grace rule.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tracing::Instrument;

use super::{JobShared, WorkerContext};

/// The type-erased body: called once, inside the worker, with its context.
pub(crate) type BoxedBody = Box<dyn FnOnce(WorkerContext) -> BoxFuture<'static, ()> + Send>;

pub(crate) struct WorkerActor;

pub(crate) struct WorkerArgs {
    pub(crate) body: BoxedBody,
    pub(crate) ctx: WorkerContext,
    pub(crate) shared: Arc<JobShared>,
    pub(crate) grace: Duration,
    /// Where the lease's GPU work runs (checked out before the body).
    #[cfg(feature = "gpu")]
    pub(crate) gpu: Option<(Arc<crate::gpu::GpuPool>, crate::gpu::Placement)>,
}

pub(crate) struct WorkerState {
    args: Option<WorkerArgs>,
}

impl Actor for WorkerActor {
    type Msg = ();
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: WorkerArgs,
    ) -> Result<WorkerState, ActorProcessingErr> {
        Ok(WorkerState { args: Some(args) })
    }

    async fn post_start(
        &self,
        myself: ActorRef<()>,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(args) = state.args.take() {
            let span = args.ctx.span().clone();
            run_body(args).instrument(span).await;
        }
        // The body (and everything it owned) has been dropped inside this task, before the
        // stop: nothing of the job travels inside the supervision event.
        myself.stop(None);
        Ok(())
    }
}

/// Runs the body until it ends, or until `grace` after the job was cancelled, whichever is
/// first; a panic is recorded, never propagated (the worker always ends normally).
async fn run_body(args: WorkerArgs) {
    let WorkerArgs {
        body,
        ctx,
        shared,
        grace,
        #[cfg(feature = "gpu")]
        gpu,
    } = args;
    #[cfg(feature = "gpu")]
    if let Some((pool, placement)) = gpu {
        // May re-create a lost device (one creator, with backoff): in the worker, never in the
        // supervisor's mailbox.
        match pool.checkout(placement).await {
            Ok(job_gpu) => {
                ctx.set_gpu(job_gpu.clone());
                shared.set_gpu(job_gpu);
            }
            Err(err) => {
                tracing::error!(error = %err, "the slot's gpu device is unavailable; the body does not run");
                shared.set_gpu_unavailable(err);
                return;
            }
        }
    }
    shared.mark_started();
    // Calling the closure runs user code: it happens here, in the worker, never in the
    // supervisor's mailbox.
    let call = std::panic::catch_unwind(AssertUnwindSafe(move || body(ctx)));
    let fut = match call {
        Ok(fut) => fut,
        Err(payload) => {
            shared.record_panic(&*payload);
            return;
        }
    };
    let body = AssertUnwindSafe(fut).catch_unwind();
    let grace_over = async {
        shared.cancel.cancelled().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        biased;
        result = body => {
            if let Err(payload) = result {
                shared.record_panic(&*payload);
            }
        }
        () = grace_over => {
            tracing::warn!(?grace, "job ignored cancellation past its grace period; its body future was dropped");
        }
    }
}
