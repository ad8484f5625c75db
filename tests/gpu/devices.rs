//! GPU slots on real wgpu devices, on any backend (CI: Vulkan on lavapipe, and again with
//! `WGPU_BACKEND=gl`, GL on EGL with llvmpipe). A slot returns only after the GPU work submitted
//! under it has completed; devices belong to the supervisor, never to a job. Every order asserted
//! here comes from the GPU's own completion signals (`on_submitted_work_done`, the fence's calls
//! seen through the backend hook), never from how long the work takes.
//!
//! Without any adapter these tests skip and say so, unless `LEASEHOLD_REQUIRE_GPU=1`, which
//! makes a missing adapter a failure (CI sets it).

use crate::common;
use crate::gpu_support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{EventLog, Plan, TestBroker};
use gpu_support::{dispatch, fill_job, read_back, start};
use leasehold::{
    BackendCall, CancellationToken, FencePolicy, GpuOptions, JobSpec, Supervisor, wgpu,
};
use tokio::sync::{Barrier, oneshot};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compute_job_writes_a_storage_buffer_that_reads_back_correctly() {
    let Some(sup) = start(Supervisor::builder(), GpuOptions::new()).await else {
        return;
    };
    let words = sup
        .run(JobSpec::new("fill").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().expect("a GPU slot").clone();
            eprintln!(
                "adapter: {:?} ({:?})",
                gpu.adapter_info().name,
                gpu.adapter_info().device_type
            );
            let words = ctx
                .spawn_blocking(move || {
                    gpu.submit([dispatch(&gpu, "fill", 4)]);
                    read_back(&gpu, 256)
                })
                .await
                .unwrap();
            Ok::<_, std::io::Error>(words)
        })
        .await
        .unwrap();
    assert_eq!(words, (0..256u32).map(|i| i * 2 + 1).collect::<Vec<_>>());
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.stats.released_total, 1);
}

/// `WGPU_BACKEND` picks the backend (CI's GL pass relies on it): the device runs on one of the
/// backends it names, so a GL pass cannot silently run on Vulkan.
/// The adapter a job runs on.
async fn adapter_of_a_job(sup: &Supervisor) -> wgpu::AdapterInfo {
    sup.run(JobSpec::new("probe").unwrap(), |ctx| async move {
        Ok::<_, std::io::Error>(ctx.gpu().unwrap().adapter_info().clone())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_runs_on_a_backend_that_wgpu_backend_names() {
    let Some(sup) = start(Supervisor::builder(), GpuOptions::new()).await else {
        return;
    };
    let info = adapter_of_a_job(&sup).await;
    eprintln!(
        "adapter: {:?} ({:?}, {:?}, {:?})",
        info.name, info.device_type, info.backend, info.driver_info
    );
    if let Some(named) = wgpu::Backends::from_env() {
        assert!(
            named.contains(info.backend.into()),
            "WGPU_BACKEND names {named:?}, the device runs on {:?}",
            info.backend
        );
    }
    sup.shutdown().await.unwrap();
}

/// GL gets a wgpu instance of its own, made only when a GL adapter could be chosen: a device on
/// any other backend never keeps an EGL display alive, so dropping it never tears EGL down. (On
/// NVIDIA's driver, an EGL teardown on one thread beside a `vkDestroyDevice` on another hung
/// both, and with them this suite.) Each instance is one `Enumerate` call into the backend, and
/// every adapter an instance finds passes the adapter filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gl_gets_an_instance_of_its_own_and_only_when_it_could_be_chosen() {
    let enumerations = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&enumerations);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let filtered = Arc::clone(&seen);
    let opts = GpuOptions::new()
        .backend_hook(move |call, _device, _sub| {
            if call == BackendCall::Enumerate {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        })
        .adapter_filter(move |info| {
            filtered.lock().unwrap().push(info.backend);
            true
        });
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let info = adapter_of_a_job(&sup).await;
    let seen = seen.lock().unwrap().clone();
    let enumerations = enumerations.load(Ordering::SeqCst);
    eprintln!(
        "chose {:?} ({:?}, {:?}); {enumerations} instance(s); adapters seen: {seen:?}",
        info.name, info.device_type, info.backend
    );
    // A hardware adapter on another backend outranks every GL adapter: GL need not be looked at.
    let gl_could_win =
        info.device_type == wgpu::DeviceType::Cpu || info.backend == wgpu::Backend::Gl;
    let gl_seen = seen.contains(&wgpu::Backend::Gl);
    let others_seen = seen.iter().any(|b| *b != wgpu::Backend::Gl);
    assert!(
        !gl_seen || gl_could_win,
        "a GL instance was made beside a hardware {:?} adapter",
        info.backend
    );
    // Beside a software adapter (or none on another backend), GL could be chosen: it was
    // looked at, in an instance of its own (found adapters or not).
    let backends =
        wgpu::Backends::from_env().unwrap_or(wgpu::Backends::VULKAN | wgpu::Backends::GL);
    let split = backends.contains(wgpu::Backends::GL)
        && !backends.difference(wgpu::Backends::GL).is_empty();
    assert!(
        enumerations <= 1 + usize::from(split),
        "{enumerations} instances for {backends:?}: one per backend pass at most"
    );
    if gl_could_win && split {
        assert_eq!(
            enumerations, 2,
            "GL could be chosen beside {:?} ({:?}): it must be looked at in an instance of its own",
            info.name, info.device_type
        );
    }
    // GL adapters and others, seen from fewer instances than that: they shared one.
    assert!(
        enumerations >= usize::from(others_seen) + usize::from(gl_seen),
        "GL shared an instance with another backend ({enumerations} instance(s) for {seen:?})"
    );
    sup.shutdown().await.unwrap();
}

/// A cancelled job's body returns at once, while the GPU work it submitted may still run: the
/// slot (and its scratch) goes to the next job only after that work has completed. The order is
/// taken from the GPU's own signal (`on_submitted_work_done`, which wgpu runs from the poll that
/// sees the work done), not from how long the work takes: on GL the work may well be complete
/// before the body ends, and the order must hold all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_keeps_its_slot_until_its_gpu_work_has_completed() {
    let log = EventLog::default();
    let broker = TestBroker::new(1);
    broker.log_releases(&log);
    let Some(sup) = start(
        Supervisor::builder().broker(broker.clone()),
        GpuOptions::new(),
    )
    .await
    else {
        return;
    };
    let cancel = CancellationToken::new();
    let (submitted_tx, submitted_rx) = oneshot::channel();
    let first = {
        let (sup, log) = (sup.clone(), log.clone());
        let spec = JobSpec::new("long").unwrap().with_cancel(cancel.clone());
        tokio::spawn(async move {
            sup.run(spec, move |ctx| async move {
                let gpu = ctx.gpu().unwrap().clone();
                // Straight on the queue (covered all the same), then through the context.
                gpu.queue().submit([dispatch(&gpu, "long", 1024)]);
                gpu.submit([dispatch(&gpu, "fill", 1)]);
                assert_eq!(gpu.submissions(), 1);
                let done_log = log.clone();
                gpu.queue()
                    .on_submitted_work_done(move || done_log.push("gpu-done"));
                submitted_tx.send(()).unwrap();
                ctx.cancelled().await;
                log.push("body-end");
                Err::<(), _>(std::io::Error::from(std::io::ErrorKind::Interrupted))
            })
            .await
        })
    };
    submitted_rx.await.unwrap();
    // The lease table names the job's GPU device while it runs (written at the end of the
    // supervisor's turn that started it: polled, never slept for).
    let mut row = None;
    for _ in 0..100_000 {
        row = sup.leases().into_iter().find(|l| l.gpu_device.is_some());
        if row.is_some() {
            break;
        }
        tokio::task::yield_now().await;
    }
    let row = row.expect("the running GPU job shows its device in the lease table");
    assert_eq!(row.job_id.as_deref(), Some("long"));
    assert_eq!(row.gpu_device, Some(0));
    assert!(row.waiting_for.contains(&leasehold::WaitingFor::GpuFence));
    let second = {
        let (sup, log) = (sup.clone(), log.clone());
        tokio::spawn(async move {
            sup.run(JobSpec::new("next").unwrap(), move |_ctx| async move {
                log.push("next-start");
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    cancel.cancel();
    assert_eq!(
        first.await.unwrap().unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    second.await.unwrap().unwrap();
    let events = log.events();
    assert!(
        log.position("body-end") < log.position("release"),
        "{events:?}"
    );
    assert!(
        log.position("gpu-done") < log.position("release"),
        "the slot was released before its GPU work completed: {events:?}"
    );
    assert!(
        log.position("release") < log.position("next-start"),
        "{events:?}"
    );
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_slots_on_one_device_run_concurrently_and_never_share_scratch() {
    let Some(sup) = start(Supervisor::builder(), GpuOptions::new().slots_per_device(2)).await
    else {
        return;
    };
    let held: Arc<parking_lot::Mutex<Vec<wgpu::Buffer>>> = Arc::default();
    let barrier = Arc::new(Barrier::new(2));
    let mut jobs = Vec::new();
    for i in 0..6u32 {
        let (sup, held, barrier) = (sup.clone(), Arc::clone(&held), Arc::clone(&barrier));
        jobs.push(tokio::spawn(async move {
            sup.run(
                JobSpec::new(format!("pair-{i}")).unwrap(),
                move |ctx| async move {
                    let gpu = ctx.gpu().unwrap().clone();
                    {
                        let mut held = held.lock();
                        assert!(
                            !held.contains(&gpu.scratch().storage),
                            "scratch used by two jobs at once"
                        );
                        held.push(gpu.scratch().storage.clone());
                    }
                    if i < 2 {
                        // The first two run at the same time, on one device.
                        barrier.wait().await;
                    }
                    let id = 1000 + i;
                    let words = ctx
                        .spawn_blocking(move || {
                            gpu.queue().write_buffer(
                                &gpu.scratch().storage,
                                0,
                                &id.to_le_bytes().repeat(64),
                            );
                            gpu.submit(std::iter::empty());
                            read_back(&gpu, 64)
                        })
                        .await
                        .unwrap();
                    held.lock()
                        .retain(|b| b != &ctx.gpu().unwrap().scratch().storage);
                    assert!(
                        words.iter().all(|w| *w == id),
                        "another job wrote this slot's scratch"
                    );
                    Ok::<_, std::io::Error>(ctx.gpu().unwrap().device_index())
                },
            )
            .await
        }));
    }
    for job in jobs {
        assert_eq!(job.await.unwrap().unwrap(), 0);
    }
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_device_loss_fails_the_lease_cleanly_and_the_device_comes_back() {
    let broker = TestBroker::new(1);
    let Some(sup) = start(
        Supervisor::builder().broker(broker.clone()),
        GpuOptions::new().recreate_policy(5, Duration::from_millis(10)),
    )
    .await
    else {
        return;
    };
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
    // A job waits for the slot while the device is lost: it must not be stranded.
    let waiter = {
        let sup = sup.clone();
        tokio::spawn(async move { fill_job(&sup, "after").await })
    };
    // The device is lost (here: destroyed), and noticed (wgpu runs its lost callback in the
    // poll that sees it), before the lease ends.
    let device = sup.gpu_device(0).expect("device 0 is usable");
    device.destroy();
    let _ = device.poll(wgpu::PollType::Poll);
    lost_tx.send(()).unwrap();
    let err = victim.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_GPU_DEVICE_LOST", "{err}");
    assert!(err.body_error().is_none());
    // The device is re-created, the quarantined slot released, and the waiter runs on it.
    assert_eq!(waiter.await.unwrap().unwrap(), [1, 3, 5, 7]);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
    assert_eq!(broker.release_calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_in_flight_gpu_work_before_dropping_the_device() {
    let Some(sup) = start(Supervisor::builder(), GpuOptions::new()).await else {
        return;
    };
    let log = EventLog::default();
    {
        let log = log.clone();
        let (submitted_tx, submitted_rx) = oneshot::channel();
        let sup2 = sup.clone();
        let job = tokio::spawn(async move {
            sup2.run(JobSpec::new("background").unwrap(), move |ctx| async move {
                let gpu = ctx.gpu().unwrap().clone();
                // Submitted on the queue directly, not through `gpu.submit`: covered all the same.
                gpu.queue().submit([dispatch(&gpu, "long", 1024)]);
                gpu.queue()
                    .on_submitted_work_done(move || log.push("gpu-done"));
                submitted_tx.send(()).unwrap();
                // Returns at once, long before the GPU is done.
                Ok::<_, std::io::Error>(())
            })
            .await
        });
        submitted_rx.await.unwrap();
        let report = sup.shutdown().await.unwrap();
        assert_eq!(report.quarantined, 0);
        job.await.unwrap().unwrap();
    }
    assert_eq!(
        log.events(),
        ["gpu-done"],
        "shutdown returned before the GPU work completed"
    );
    assert!(
        sup.gpu_device(0).is_none(),
        "the device outlived the shutdown"
    );
}

/// Two leases see the same loss: the device is re-created once, by one creator, and both slots
/// come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_seen_by_several_leases_re_creates_the_device_once() {
    let broker = TestBroker::new(2);
    let Some(sup) = start(
        Supervisor::builder().broker(broker.clone()),
        GpuOptions::new()
            .slots_per_device(2)
            .recreate_policy(5, Duration::from_millis(10)),
    )
    .await
    else {
        return;
    };
    assert_eq!(sup.gpu_device_generation(0), Some(1));
    let barrier = Arc::new(Barrier::new(3));
    let mut jobs = Vec::new();
    for i in 0..2 {
        let (sup, barrier) = (sup.clone(), Arc::clone(&barrier));
        jobs.push(tokio::spawn(async move {
            sup.run(
                JobSpec::new(format!("held-{i}")).unwrap(),
                move |ctx| async move {
                    // GPU work of its own: the device's loss is the lease's.
                    let gpu = ctx.gpu().unwrap();
                    gpu.submit([dispatch(gpu, "fill", 1)]);
                    barrier.wait().await; // both hold a slot
                    barrier.wait().await; // the device is gone
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        }));
    }
    barrier.wait().await;
    // The device is lost (here: destroyed), and noticed before the leases end: wgpu runs the
    // lost callback of a destroyed device in the poll that finds its queue empty. (A lease
    // whose work completed before a loss that nobody has noticed yet ends well: its fence
    // finds its work done.)
    let device = sup.gpu_device(0).unwrap();
    device.destroy();
    let _ = device.poll(wgpu::PollType::wait_indefinitely());
    barrier.wait().await;
    for job in jobs {
        assert_eq!(
            job.await.unwrap().unwrap_err().code(),
            "LEASE_GPU_DEVICE_LOST"
        );
    }
    // Both slots come back on the re-created device: two jobs hold them at once (a slot still
    // quarantined would keep the second one waiting).
    let both = Arc::new(Barrier::new(2));
    let fresh = |i: u32| {
        let (sup, both) = (sup.clone(), Arc::clone(&both));
        async move {
            sup.run(
                JobSpec::new(format!("fresh-{i}")).unwrap(),
                |ctx| async move {
                    both.wait().await;
                    Ok::<_, std::io::Error>(ctx.gpu().unwrap().device_index())
                },
            )
            .await
            .unwrap()
        }
    };
    let (a, b) = tokio::join!(fresh(0), fresh(1));
    assert_eq!((a, b), (0, 0));
    assert_eq!(
        sup.gpu_device_generation(0),
        Some(2),
        "the device was re-created more than once"
    );
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
}

/// With several slots on one device, `FencePolicy::Queue` (the default) makes the release of a
/// lease that took its queue wait for everything queued before it, other slots' work included;
/// `FencePolicy::Recorded` waits only for what the lease submitted through its context. Under
/// either, a lease with no GPU work (nothing submitted, neither queue nor scratch taken)
/// releases without a single call into the GPU backend. What each fence did is seen through
/// the backend hook; that the other slot's work had completed, through its own completion
/// signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_policy_decides_whether_a_release_waits_for_other_slots_work() {
    for policy in [FencePolicy::Queue, FencePolicy::Recorded] {
        let log = EventLog::default();
        let broker = TestBroker::new(2);
        {
            let log = log.clone();
            broker.on_release(move |lease| {
                log.push(format!("release-{lease}"));
                Plan::Ok
            });
        }
        let calls = log.clone();
        let opts = GpuOptions::new()
            .slots_per_device(2)
            .fence_policy(policy)
            .backend_hook(move |call, _device, sub| {
                if matches!(
                    call,
                    BackendCall::FencePoll
                        | BackendCall::FenceSubmit
                        | BackendCall::FenceWait
                        | BackendCall::ZeroScratch
                ) {
                    calls.push(format!("{call:?}-{}", sub.expect("a lease's sub-slot")));
                }
            });
        let Some(sup) = start(Supervisor::builder().broker(broker.clone()), opts).await else {
            return;
        };
        let (submitted_tx, submitted_rx) = oneshot::channel();
        let gate = Arc::new(tokio::sync::Notify::new());
        // Lease 1, sub-slot 0: long work through its context, then it holds the slot.
        let busy = {
            let (sup, log, gate) = (sup.clone(), log.clone(), Arc::clone(&gate));
            tokio::spawn(async move {
                sup.run(JobSpec::new("busy").unwrap(), move |ctx| async move {
                    let gpu = ctx.gpu().unwrap().clone();
                    gpu.submit([dispatch(&gpu, "long", 1024)]);
                    gpu.queue()
                        .on_submitted_work_done(move || log.push("busy-gpu-done"));
                    submitted_tx.send(()).unwrap();
                    gate.notified().await;
                    Ok::<_, std::io::Error>(())
                })
                .await
            })
        };
        submitted_rx.await.unwrap();
        // Lease 2, sub-slot 1 of the same device: no GPU work at all.
        sup.run(JobSpec::new("idle").unwrap(), |ctx| async move {
            assert_eq!(ctx.gpu().unwrap().device_index(), 0);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap();
        // Lease 3, sub-slot 1 again: takes the queue (a write of its own, left pending).
        sup.run(JobSpec::new("writer").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().unwrap();
            let own = gpu.device().create_buffer(&wgpu::BufferDescriptor {
                label: Some("own"),
                size: 16,
                usage: wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            gpu.queue().write_buffer(&own, 0, &[7; 16]);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap();
        let sub_1 = |events: &[String]| -> Vec<String> {
            events
                .iter()
                .filter(|e| e.ends_with("-1") || *e == "release-2" || *e == "release-3")
                .cloned()
                .collect()
        };
        let before_busy_ends = sub_1(&log.events());
        gate.notify_one();
        busy.await.unwrap().unwrap();
        let events = log.events();
        match policy {
            FencePolicy::Queue => {
                assert_eq!(
                    before_busy_ends,
                    [
                        "release-2",
                        "FencePoll-1",
                        "FenceSubmit-1",
                        "FenceWait-1",
                        "release-3"
                    ],
                    "{policy:?}: the idle lease releases without a call into the backend; the \
                     writer's fence submits and waits: {events:?}"
                );
                assert!(
                    log.position("busy-gpu-done") < log.position("release-3"),
                    "{policy:?}: the writer was released before the work queued before its \
                     fence completed: {events:?}"
                );
            }
            _ => {
                assert_eq!(
                    before_busy_ends,
                    ["release-2", "release-3"],
                    "{policy:?}: neither the idle lease nor the writer recorded a submission; \
                     their releases must neither poll, submit nor wait: {events:?}"
                );
            }
        }
        assert!(
            log.position("FenceWait-0") < log.position("release-1")
                && log.position("busy-gpu-done") < log.position("release-1"),
            "{policy:?}: the busy lease's release did not wait for its own work: {events:?}"
        );
        let report = sup.shutdown().await.unwrap();
        broker.assert_quiescent(report.stats);
    }
}

/// A job actor (`spawn_job`) that submits GPU work in a handler and stops at once, without
/// waiting for it: its slot goes back only after that work has completed (the GPU's own
/// completion callback) and after the actor's state was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_actor_keeps_its_slot_until_the_gpu_work_it_submitted_has_completed() {
    use leasehold::WorkerContext;
    use leasehold::ractor::{Actor, ActorProcessingErr, ActorRef};

    struct Shader {
        log: EventLog,
    }

    struct ShaderState {
        ctx: WorkerContext,
        log: EventLog,
    }

    impl Drop for ShaderState {
        fn drop(&mut self) {
            self.log.push("state-dropped");
        }
    }

    impl Actor for Shader {
        type Msg = ();
        type State = ShaderState;
        type Arguments = WorkerContext;

        async fn pre_start(
            &self,
            _myself: ActorRef<()>,
            ctx: WorkerContext,
        ) -> Result<ShaderState, ActorProcessingErr> {
            Ok(ShaderState {
                ctx,
                log: self.log.clone(),
            })
        }

        async fn handle(
            &self,
            myself: ActorRef<()>,
            (): (),
            state: &mut ShaderState,
        ) -> Result<(), ActorProcessingErr> {
            let gpu = state.ctx.gpu().expect("a GPU slot").clone();
            gpu.submit([dispatch(&gpu, "long", 1024)]);
            let log = self.log.clone();
            gpu.queue()
                .on_submitted_work_done(move || log.push("gpu-done"));
            myself.stop(Some("submitted".into()));
            Ok(())
        }
    }

    let log = EventLog::default();
    let broker = TestBroker::new(1);
    broker.log_releases(&log);
    let Some(sup) = start(
        Supervisor::builder().broker(broker.clone()),
        GpuOptions::new(),
    )
    .await
    else {
        return;
    };
    let shader = Shader { log: log.clone() };
    let (actor, outcome) = sup
        .spawn_job(JobSpec::new("shader-actor").unwrap(), shader, |ctx| ctx)
        .await
        .unwrap();
    actor.cast(()).unwrap();
    let exit = outcome.join().await.unwrap();
    assert_eq!(exit.reason(), Some("submitted"));
    let events = log.events();
    assert!(
        log.position("state-dropped") < log.position("release"),
        "{events:?}"
    );
    assert!(
        log.position("gpu-done") < log.position("release"),
        "the slot was released before the actor's GPU work completed: {events:?}"
    );
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
}
