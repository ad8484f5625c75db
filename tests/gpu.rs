//! GPU slots on real wgpu devices (CI: Vulkan lavapipe). A slot returns only after the GPU work
//! submitted under it has completed; devices belong to the supervisor, never to a job.
//!
//! Without any adapter these tests skip and say so, unless `LEASEHOLD_REQUIRE_GPU=1`, which
//! makes a missing adapter a failure (CI sets it).
#![cfg(feature = "gpu")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{EventLog, Plan, TestBroker};
use leasehold::{
    CancellationToken, GpuError, GpuOptions, JobGpu, JobSpec, StartError, Supervisor,
    SupervisorBuilder, wgpu,
};
use tokio::sync::{Barrier, oneshot};

const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;

// About 250 ms on lavapipe with 1024 x 64 invocations: long enough to see the fence.
@compute @workgroup_size(64)
fn long(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < 20000u; i = i + 1u) {
        x = x * 1664525u + 1013904223u;
    }
    data[gid.x + 1u] = x;
}

@compute @workgroup_size(1)
fn mark() {
    data[0] = 0xA11u;
}

@compute @workgroup_size(64)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>) {
    data[gid.x] = gid.x * 2u + 1u;
}
"#;

/// Starts a supervisor on a GPU, or says loudly why it cannot.
async fn start(builder: SupervisorBuilder, opts: GpuOptions) -> Option<Supervisor> {
    match builder.gpu(opts).start().await {
        Ok(sup) => Some(sup),
        Err(StartError::Gpu(GpuError::NoAdapter)) => {
            if std::env::var("LEASEHOLD_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!(
                    "LEASEHOLD_REQUIRE_GPU=1 but no GPU adapter was found (install mesa-vulkan-drivers)"
                );
            }
            eprintln!(
                "\n*** SKIPPED: no GPU adapter (Vulkan or GL) on this machine; install mesa-vulkan-drivers for lavapipe ***\n"
            );
            None
        }
        Err(e) => panic!("could not start on a GPU: {e:?}"),
    }
}

fn dispatch(gpu: &JobGpu, entry: &str, groups: u32) -> wgpu::CommandBuffer {
    let device = gpu.device();
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("test"),
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: gpu.scratch().storage.as_entire_binding(),
        }],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(groups, 1, 1);
    }
    encoder.finish()
}

/// Copies the first `n` words of the slot's scratch to its readback buffer and reads them.
fn read_back(gpu: &JobGpu, n: u64) -> Vec<u32> {
    let scratch = gpu.scratch();
    let mut encoder = gpu.device().create_command_encoder(&Default::default());
    encoder.copy_buffer_to_buffer(&scratch.storage, 0, &scratch.readback, 0, n * 4);
    gpu.submit([encoder.finish()]);
    scratch
        .readback
        .map_async(wgpu::MapMode::Read, 0..n * 4, |r| r.unwrap());
    gpu.device()
        .poll(wgpu::PollType::wait_indefinitely())
        .unwrap();
    let words = {
        let view = scratch.readback.get_mapped_range(0..n * 4).unwrap();
        view.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    scratch.readback.unmap();
    words
}

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

/// A cancelled job's body returns at once while its GPU work still runs: the slot (and its
/// scratch) goes to the next job only after that work has completed, as the GPU's own
/// completion callback tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_keeps_its_slot_until_its_gpu_work_has_completed() {
    let log = EventLog::default();
    let broker = TestBroker::new(1);
    {
        let log = log.clone();
        broker.on_release(move |_| {
            log.push("release");
            Plan::Ok
        });
    }
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
                // Clear the marker, then the long work, then the marker after it.
                gpu.queue()
                    .write_buffer(&gpu.scratch().storage, 0, &0u32.to_le_bytes());
                // The long work straight on the queue (covered all the same), the marker
                // through the context (recorded).
                gpu.queue().submit([dispatch(&gpu, "long", 1024)]);
                gpu.submit([dispatch(&gpu, "mark", 1)]);
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
    let second = {
        let (sup, log) = (sup.clone(), log.clone());
        tokio::spawn(async move {
            sup.run(JobSpec::new("next").unwrap(), move |ctx| async move {
                log.push("next-start");
                let gpu = ctx.gpu().unwrap().clone();
                let marker = ctx
                    .spawn_blocking(move || read_back(&gpu, 1)[0])
                    .await
                    .unwrap();
                Ok::<_, std::io::Error>(marker)
            })
            .await
        })
    };
    cancel.cancel();
    assert_eq!(
        first.await.unwrap().unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    let marker = second.await.unwrap().unwrap();
    assert_eq!(
        marker, 0xA11,
        "the next job saw the scratch before the GPU work ended"
    );
    let events = log.events();
    assert_eq!(events[0], "body-end", "{events:?}");
    assert!(
        log.position("gpu-done") < log.position("release"),
        "{events:?}"
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
                running_tx.send(()).unwrap();
                lost_rx.await.unwrap();
                let _ = ctx;
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    running_rx.await.unwrap();
    // A job waits for the slot while the device is lost: it must not be stranded.
    let waiter = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("after").unwrap(), |ctx| async move {
                let gpu = ctx.gpu().unwrap().clone();
                let words = ctx
                    .spawn_blocking(move || {
                        gpu.submit([dispatch(&gpu, "fill", 1)]);
                        read_back(&gpu, 4)
                    })
                    .await
                    .unwrap();
                Ok::<_, std::io::Error>(words)
            })
            .await
        })
    };
    sup.gpu_device(0).expect("device 0 is usable").destroy();
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
                move |_ctx| async move {
                    barrier.wait().await; // both hold a slot
                    barrier.wait().await; // the device is gone
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        }));
    }
    barrier.wait().await;
    sup.gpu_device(0).unwrap().destroy();
    barrier.wait().await;
    for job in jobs {
        assert_eq!(
            job.await.unwrap().unwrap_err().code(),
            "LEASE_GPU_DEVICE_LOST"
        );
    }
    // A new job gets the re-created device.
    let index = sup
        .run(JobSpec::new("fresh").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>(ctx.gpu().unwrap().device_index())
        })
        .await
        .unwrap();
    assert_eq!(index, 0);
    assert_eq!(
        sup.gpu_device_generation(0),
        Some(2),
        "the device was re-created more than once"
    );
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
}

/// With several slots on one device, `FencePolicy::Queue` (the default) makes a lease's release
/// wait for everything queued before it, other slots' work included; `FencePolicy::Recorded`
/// waits only for what the lease submitted through its context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_policy_decides_whether_a_release_waits_for_other_slots_work() {
    use leasehold::FencePolicy;
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
        let opts = GpuOptions::new().slots_per_device(2).fence_policy(policy);
        let Some(sup) = start(Supervisor::builder().broker(broker.clone()), opts).await else {
            return;
        };
        let (submitted_tx, submitted_rx) = oneshot::channel();
        let gate = Arc::new(tokio::sync::Notify::new());
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
        // A job that submits nothing, on the other slot of the same device.
        sup.run(JobSpec::new("idle").unwrap(), |_ctx| async {
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap();
        gate.notify_one();
        busy.await.unwrap().unwrap();
        let events = log.events();
        let idle_release = log.position("release-2");
        let busy_done = log.position("busy-gpu-done");
        match policy {
            FencePolicy::Queue => assert!(busy_done < idle_release, "{policy:?}: {events:?}"),
            _ => assert!(idle_release < busy_done, "{policy:?}: {events:?}"),
        }
        let report = sup.shutdown().await.unwrap();
        broker.assert_quiescent(report.stats);
    }
}
