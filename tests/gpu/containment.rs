//! A panicking GPU backend never stops the supervisor (DESIGN.md invariant 9): a panic in any
//! backend call leasehold makes is a loss of the device — the lease concerned is quarantined and
//! answered `LEASE_GPU_DEVICE_LOST`, the device is re-created (or given up), and the slots serve
//! again. The panics are injected through `GpuOptions::backend_hook` (hidden, for these tests),
//! which runs inside the same guard as the backend call it stands for. Runs on any backend (see
//! `tests/gpu/devices.rs`).

use crate::common;
use crate::gpu_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{TestBroker, ThreadGate};
use gpu_support::{dispatch, fill_and_read, fill_job, start};
use leasehold::{
    BackendCall, GpuDeviceState, GpuError, GpuOptions, JobSpec, StartError, Supervisor,
};
use tokio::sync::{Barrier, oneshot};

/// A hook that panics the first time `call` is made after `armed` is set.
fn panic_once_at(
    call: BackendCall,
    armed: &Arc<AtomicBool>,
) -> impl Fn(BackendCall, usize, Option<usize>) + Send + Sync + 'static {
    let armed = Arc::clone(armed);
    move |made, _device, _sub| {
        if made == call && armed.swap(false, Ordering::SeqCst) {
            panic!("injected backend panic at {call:?}");
        }
    }
}

/// [`fill_job`], which first waits at `barrier` while holding its slot.
async fn fill_job_holding(sup: &Supervisor, id: &str, barrier: Arc<Barrier>) -> Vec<u32> {
    sup.run(JobSpec::new(id).unwrap(), |ctx| async move {
        barrier.wait().await;
        let gpu = ctx.gpu().unwrap().clone();
        let words = ctx
            .spawn_blocking(move || fill_and_read(&gpu))
            .await
            .unwrap();
        Ok::<_, std::io::Error>(words)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_panic_in_the_release_fence_is_a_device_loss_and_the_slots_serve_again() {
    let armed = Arc::new(AtomicBool::new(false));
    let broker = TestBroker::new(2);
    let opts = GpuOptions::new()
        .slots_per_device(2)
        .recreate_policy(5, Duration::from_millis(10))
        .backend_hook(panic_once_at(BackendCall::FenceWait, &armed));
    let Some(sup) = start(Supervisor::builder().broker(broker.clone()), opts).await else {
        return;
    };
    armed.store(true, Ordering::SeqCst);
    let err = sup
        .run(JobSpec::new("victim").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            gpu.submit([dispatch(&gpu, "fill", 1)]);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_GPU_DEVICE_LOST", "{err}");
    assert!(err.body_error().is_none());
    let cleanup = err.cleanup_error().unwrap().to_string();
    assert!(cleanup.contains("panicked"), "{cleanup}");
    // The device was re-created, and both sub-slots serve again, at once (a slot still
    // quarantined would keep the second job waiting at the barrier's door).
    let both = Arc::new(Barrier::new(2));
    let (a, b) = tokio::join!(
        fill_job_holding(&sup, "after-0", Arc::clone(&both)),
        fill_job_holding(&sup, "after-1", Arc::clone(&both))
    );
    assert_eq!((a, b), (vec![1, 3, 5, 7], vec![1, 3, 5, 7]));
    assert_eq!(sup.gpu_device_generation(0), Some(2));
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_panic_in_a_submission_fails_the_lease_with_device_lost() {
    let armed = Arc::new(AtomicBool::new(false));
    let opts = GpuOptions::new()
        .recreate_policy(5, Duration::from_millis(10))
        .backend_hook(panic_once_at(BackendCall::Submit, &armed));
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    armed.store(true, Ordering::SeqCst);
    let (seen_tx, seen_rx) = oneshot::channel();
    let err = sup
        .run(JobSpec::new("victim").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().unwrap().clone();
            let submitted = gpu.try_submit([dispatch(&gpu, "fill", 1)]);
            seen_tx.send(submitted.map(|_| ())).unwrap();
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    let seen = seen_rx.await.unwrap().unwrap_err();
    assert!(matches!(seen, GpuError::DeviceLost(_)), "{seen:?}");
    assert_eq!(err.code(), "LEASE_GPU_DEVICE_LOST", "{err}");
    assert_eq!(fill_job(&sup, "after").await.unwrap(), [1, 3, 5, 7]);
    assert_eq!(sup.gpu_device_generation(0), Some(2));
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

/// A `JobGpu` may be dropped anywhere, here on an async task after its job: the backend panic
/// its drop runs into is contained and counts as a loss, and the next job gets a new device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_panic_while_a_job_gpu_is_dropped_is_contained() {
    let armed = Arc::new(AtomicBool::new(false));
    let opts = GpuOptions::new()
        .recreate_policy(5, Duration::from_millis(10))
        .backend_hook(panic_once_at(BackendCall::Drop, &armed));
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let kept = sup
        .run(JobSpec::new("keeper").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>(ctx.gpu().unwrap().clone())
        })
        .await
        .unwrap();
    // A round trip through the supervisor's mailbox: the handler that answered the job (and
    // dropped the supervisor's record of it) has finished, so `kept` is the last clone.
    assert!(sup.quarantined().await.unwrap().is_empty());
    armed.store(true, Ordering::SeqCst);
    drop(kept);
    assert!(
        !armed.load(Ordering::SeqCst),
        "the drop never reached the backend hook"
    );
    assert_eq!(fill_job(&sup, "after").await.unwrap(), [1, 3, 5, 7]);
    assert_eq!(sup.gpu_device_generation(0), Some(2));
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

/// A device that cannot be re-created (every attempt panics) is given up: its quarantined slot
/// goes back, new jobs are refused with `LEASE_PREPARE_FAILED`, and the supervisor keeps
/// answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_re_creation_keeps_panicking_is_given_up() {
    let armed = Arc::new(AtomicBool::new(false));
    let hook = {
        let armed = Arc::clone(&armed);
        move |call, _device, _sub| {
            if call == BackendCall::RequestDevice && armed.load(Ordering::SeqCst) {
                panic!("injected backend panic at {call:?}");
            }
        }
    };
    let broker = TestBroker::new(1);
    let opts = GpuOptions::new()
        .recreate_policy(2, Duration::from_millis(10))
        .backend_hook(hook);
    let Some(sup) = start(Supervisor::builder().broker(broker.clone()), opts).await else {
        return;
    };
    armed.store(true, Ordering::SeqCst);
    let (running_tx, running_rx) = oneshot::channel();
    let (lost_tx, lost_rx) = oneshot::channel::<()>();
    let victim = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("victim").unwrap(), move |ctx| async move {
                // GPU work of its own: the device's loss is the lease's.
                let gpu = ctx.gpu().unwrap();
                gpu.submit([dispatch(gpu, "fill", 1)]);
                running_tx.send(()).unwrap();
                lost_rx.await.unwrap();
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    running_rx.await.unwrap();
    let device = sup.gpu_device(0).unwrap();
    device.destroy();
    let _ = device.poll(leasehold::wgpu::PollType::Poll);
    lost_tx.send(()).unwrap();
    assert_eq!(
        victim.await.unwrap().unwrap_err().code(),
        "LEASE_GPU_DEVICE_LOST"
    );
    let refused = sup
        .run(JobSpec::new("refused").unwrap(), |_ctx| async move {
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "LEASE_PREPARE_FAILED", "{refused}");
    assert!(refused.prepare_error().is_some(), "{refused:?}");
    assert_eq!(sup.gpu_device_generation(0), Some(1));
    let state = &sup.gpu_devices()[0].state;
    assert!(
        matches!(state, GpuDeviceState::GivenUp { reason: Some(_) }),
        "{state:?}"
    );
    assert_eq!(sup.stats().active, 0);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_panic_while_opening_is_a_start_error() {
    let armed = Arc::new(AtomicBool::new(true));
    let opts = GpuOptions::new().backend_hook(panic_once_at(BackendCall::Enumerate, &armed));
    match Supervisor::builder().gpu(opts).start().await {
        Err(StartError::Gpu(GpuError::CreateFailed(why))) => {
            assert!(why.contains("panicked"), "{why}")
        }
        Err(e) => panic!("unexpected start error: {e:?}"),
        Ok(_) => panic!("started although the backend panicked"),
    }
}

/// The same at the second look for adapters, GL's in an instance of its own (made where the
/// first found no hardware adapter: on CI's software drivers with the default backends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_panic_while_looking_at_gl_after_the_others_is_a_start_error() {
    let enumerations = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&enumerations);
    let opts = GpuOptions::new().backend_hook(move |call, _device, _sub| {
        if call == BackendCall::Enumerate && counted.fetch_add(1, Ordering::SeqCst) == 1 {
            panic!("injected backend panic at the second {call:?}");
        }
    });
    match Supervisor::builder().gpu(opts).start().await {
        Err(StartError::Gpu(GpuError::CreateFailed(why))) => {
            assert!(why.contains("panicked"), "{why}");
            assert_eq!(enumerations.load(Ordering::SeqCst), 2);
        }
        // One look only (one backend named, or a hardware adapter found first): no second
        // call to fault here, which the count shows.
        Ok(sup) => {
            assert_eq!(
                enumerations.load(Ordering::SeqCst),
                1,
                "a second look did not panic"
            );
            eprintln!("one look for adapters here: the second look is not faulted on this machine");
            sup.shutdown().await.unwrap();
        }
        Err(StartError::Gpu(GpuError::NoAdapter)) => {
            assert_eq!(
                enumerations.load(Ordering::SeqCst),
                1,
                "a second look did not panic"
            );
            eprintln!("one look, no adapter: the second look is not faulted on this machine");
        }
        Err(e) => panic!("unexpected start error: {e:?}"),
    }
}

/// `shutdown` waits for each device's remaining work at most the fence timeout: a device whose
/// close never ends (the hook blocks it for good, as GPU work that never completes would) is left
/// to its own thread and `shutdown` returns. The thread stays blocked until the test binary
/// exits: letting it go on would have it destroy the device while the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_without_end_for_a_device_that_never_drains() {
    let (entered, never) = (ThreadGate::default(), ThreadGate::default());
    let hook = {
        let entered = entered.clone();
        move |call, _device, _sub| {
            if call == BackendCall::Close {
                entered.open();
                never.wait();
            }
        }
    };
    let opts = GpuOptions::new()
        .fence_timeout(Duration::from_millis(300))
        .backend_hook(hook);
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    assert_eq!(fill_job(&sup, "work").await.unwrap(), [1, 3, 5, 7]);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    let unclosed: Vec<Option<usize>> = report.unclosed_devices.iter().map(|u| u.device).collect();
    assert_eq!(unclosed, [Some(0)], "{report:?}");
    // The close did reach the device (and blocks there still), so `shutdown` returned without it.
    entered.wait();
    assert!(sup.gpu_device(0).is_none());
    assert_eq!(sup.gpu_devices()[0].state, GpuDeviceState::Closed);
}

/// A fence that runs past its bound and then fails (a driver's reset; here a backend panic in
/// the wait, once the slot is quarantined as late) is a device loss, never a proof: the slot
/// stays quarantined until the device is re-created, and only then serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_fence_that_fails_is_a_device_loss_not_a_proof() {
    let armed = Arc::new(AtomicBool::new(false));
    let go = ThreadGate::default();
    let hook = {
        let (armed, go) = (Arc::clone(&armed), go.clone());
        move |call, _device, _sub| {
            if call == BackendCall::FenceWait && armed.swap(false, Ordering::SeqCst) {
                go.wait();
                panic!("injected: the device was reset while a late fence waited");
            }
        }
    };
    let opts = GpuOptions::new()
        .fence_timeout(Duration::from_millis(100))
        .recreate_policy(5, Duration::from_millis(10))
        .backend_hook(hook);
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    armed.store(true, Ordering::SeqCst);
    let job = tokio::spawn({
        let sup = sup.clone();
        async move {
            sup.run(JobSpec::new("late").unwrap(), |ctx| async move {
                let gpu = ctx.gpu().unwrap().clone();
                gpu.submit([dispatch(&gpu, "fill", 1)]);
                Ok::<_, std::io::Error>(())
            })
            .await
        }
    });
    common::until("the late fence quarantines the slot", || {
        sup.stats().quarantined == 1
    })
    .await;
    // The job was answered at the fence's bound: its cleanup is unconfirmed.
    let err = job.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED", "{err}");
    go.open();
    // The quarantine ends only once the device has been re-created: the failed wait proved
    // nothing (before, it counted as the proof, and freed the slot on the lost device).
    common::until("the quarantine ends", || sup.stats().quarantined == 0).await;
    assert_eq!(
        sup.gpu_device_generation(0),
        Some(2),
        "the slot was freed before its device was re-created: {:?}",
        sup.gpu_devices()
    );
    assert_eq!(fill_job(&sup, "after").await.unwrap(), [1, 3, 5, 7]);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}
