//! GPU slots on a device the engine created (`GpuOptions::adopt`): leases, fences and scratch
//! isolation on it, its loss (quarantine until the engine hands a replacement over, other
//! devices serving meanwhile), the device still the engine's after `shutdown()`, and a leased
//! job's texture read by the engine's own pass without a copy through the CPU.
//!
//! Runs on whatever adapter the machine has: CI runs it on Vulkan (lavapipe) and again with
//! `WGPU_BACKEND=gl` (llvmpipe through EGL). Every ordering is read from the GPU's own
//! completion signals (`on_submitted_work_done`), never from timing.

use crate::common;
use crate::gpu_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::{EventLog, TestBroker};
use gpu_support::{dispatch, engine_device, fill_and_read, fill_job, pattern, read_back, start};
use leasehold::{
    BackendCall, GpuDeviceState, GpuOptions, JobSpec, ScratchPolicy, Supervisor, wgpu,
};
use tokio::sync::oneshot;

/// A held job's task: its `run` result.
type Held = tokio::task::JoinHandle<Result<(), leasehold::JobError<std::io::Error>>>;

/// Starts job `id` on `sup`, which submits GPU work through its lease (a loss of its device
/// is then the lease's: a lease with no GPU work is not failed by one), reports its device
/// index and then holds its slot until `release` is sent (or dropped).
fn hold(sup: &Supervisor, id: &str) -> (oneshot::Receiver<usize>, oneshot::Sender<()>, Held) {
    let (running_tx, running_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let (sup, id) = (sup.clone(), id.to_owned());
    let job = tokio::spawn(async move {
        sup.run(JobSpec::new(id).unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().expect("a gpu slot");
            gpu.submit([dispatch(gpu, "fill", 1)]);
            running_tx.send(gpu.device_index()).unwrap();
            let _ = release_rx.await;
            Ok::<_, std::io::Error>(())
        })
        .await
    });
    (running_rx, release_tx, job)
}

/// The engine's device, handed over to a supervisor with `slots` sub-slots on it.
async fn adopted(slots: u32) -> Option<(Supervisor, wgpu::Device, wgpu::Queue)> {
    let (device, queue, info) = engine_device().await?;
    let opts = GpuOptions::new()
        .adopt(device.clone(), queue.clone(), info)
        .slots_per_device(slots);
    let sup = start(Supervisor::builder(), opts).await?;
    Some((sup, device, queue))
}

/// A supervisor on the engine's device alone makes no wgpu instance of its own: it looks for no
/// adapter, so it sets up no driver (no EGL display among them) beside the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_on_the_engines_device_alone_makes_no_instance_of_its_own() {
    let Some((device, queue, info)) = engine_device().await else {
        return;
    };
    let enumerations = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&enumerations);
    let opts =
        GpuOptions::new()
            .adopt(device, queue, info)
            .backend_hook(move |call, _device, _sub| {
                if call == BackendCall::Enumerate {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
            });
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    assert_eq!(
        fill_job(&sup, "on-the-engines-device").await.unwrap(),
        [1, 3, 5, 7]
    );
    sup.shutdown().await.unwrap();
    assert_eq!(enumerations.load(Ordering::SeqCst), 0, "instances made");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_leases_a_sub_slot_of_the_engines_device_and_runs_on_it() {
    let Some((sup, device, _queue)) = adopted(2).await else {
        return;
    };
    assert_eq!(
        sup.stats().capacity,
        Some(2),
        "two sub-slots on the one adopted device"
    );
    let same = Arc::new(AtomicBool::new(false));
    let seen = Arc::clone(&same);
    let engine = device.clone();
    let words = sup
        .run(
            JobSpec::new("on-the-engines-device").unwrap(),
            move |ctx| async move {
                let gpu = ctx.gpu().expect("a gpu slot").clone();
                seen.store(same_device(gpu.device(), &engine), Ordering::SeqCst);
                let words = ctx
                    .spawn_blocking(move || fill_and_read(&gpu))
                    .await
                    .unwrap();
                Ok::<_, std::io::Error>(words)
            },
        )
        .await
        .unwrap();
    assert_eq!(words, [1, 3, 5, 7]);
    assert!(
        same.load(Ordering::SeqCst),
        "the job's device is the engine's own"
    );
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    assert!(
        report.unclosed_devices.is_empty(),
        "{:?}",
        report.unclosed_devices
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_waits_for_engine_work_queued_before_the_lease_ended_on_the_shared_queue() {
    let Some((sup, device, queue)) = adopted(1).await else {
        return;
    };
    // The engine queues long work on the shared queue while the job runs; the job's release
    // (FencePolicy::Queue, the default) waits for everything queued before its fence.
    let (running_tx, running_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(
                JobSpec::new("shares-the-queue").unwrap(),
                move |ctx| async move {
                    running_tx.send(()).unwrap();
                    go_rx.await.unwrap();
                    let gpu = ctx.gpu().expect("a gpu slot").clone();
                    gpu.submit([dispatch(&gpu, "fill", 1)]);
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        })
    };
    running_rx.await.unwrap();
    let engine_done = Arc::new(AtomicBool::new(false));
    {
        let engine_buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("engine"),
            size: 4 * (1024 * 64 + 1),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let commands = engine_pass(&device, &engine_buffer, "long", 1024);
        queue.submit([commands]);
        let done = Arc::clone(&engine_done);
        queue.on_submitted_work_done(move || done.store(true, Ordering::SeqCst));
    }
    go_tx.send(()).unwrap();
    job.await.unwrap().unwrap();
    // Released: the fence on the shared queue came after the engine's work.
    let _ = device.poll(wgpu::PollType::Poll);
    assert!(
        engine_done.load(Ordering::SeqCst),
        "the lease was released before the engine work queued ahead of its fence completed"
    );
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_lease_on_an_adopted_device_never_reads_the_previous_ones_scratch() {
    let Some((device, queue, info)) = engine_device().await else {
        return;
    };
    let opts = GpuOptions::new()
        .adopt(device, queue, info)
        .scratch_policy(ScratchPolicy::Zeroed);
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let n = 16;
    sup.run(JobSpec::new("writes").unwrap(), move |ctx| async move {
        let gpu = ctx.gpu().expect("a gpu slot").clone();
        gpu.queue()
            .write_buffer(&gpu.scratch().storage, 0, &gpu_support::bytes(&pattern(n)));
        gpu.submit(std::iter::empty());
        Ok::<_, std::io::Error>(())
    })
    .await
    .unwrap();
    let seen = sup
        .run(JobSpec::new("reads").unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().expect("a gpu slot").clone();
            Ok::<_, std::io::Error>(
                ctx.spawn_blocking(move || read_back(&gpu, n))
                    .await
                    .unwrap(),
            )
        })
        .await
        .unwrap();
    assert_eq!(
        seen,
        vec![0; n as usize],
        "the previous lease's data leaked"
    );
    sup.shutdown().await.unwrap();
}

/// A lost adopted device: the lease on it ends `LEASE_GPU_DEVICE_LOST` and its slot stays
/// quarantined (nothing re-creates the engine's device) while the other adopted device serves;
/// `replace_device` brings the slot back, and a job waiting for it runs on the new device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_adopted_device_stays_quarantined_until_the_engine_replaces_it() {
    let (Some((d0, q0, i0)), Some((d1, q1, i1))) = (engine_device().await, engine_device().await)
    else {
        return;
    };
    let broker = TestBroker::new(2);
    let opts = GpuOptions::new()
        .adopt(d0.clone(), q0, i0.clone())
        .adopt(d1, q1, i1);
    let Some(sup) = start(Supervisor::builder().broker(broker.clone()), opts).await else {
        return;
    };
    let (running_rx, lost_tx, victim) = hold(&sup, "victim");
    assert_eq!(
        running_rx.await.unwrap(),
        0,
        "the first lease goes to device 0"
    );
    // The engine loses device 0 (a driver reset; here, destroy()).
    d0.destroy();
    let _ = d0.poll(wgpu::PollType::Poll);
    lost_tx.send(()).unwrap();
    let err = victim.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_GPU_DEVICE_LOST", "{err}");
    assert_eq!(sup.stats().quarantined, 1, "its slot is quarantined");
    let row = sup.quarantined().await.unwrap();
    assert_eq!(row.len(), 1);
    // Device 1 keeps serving, more than once.
    for i in 0..3 {
        assert_eq!(
            fill_job(&sup, &format!("meanwhile-{i}")).await.unwrap(),
            [1, 3, 5, 7]
        );
    }
    assert_eq!(
        sup.stats().quarantined,
        1,
        "nothing re-created the engine's device"
    );
    let devices = sup.gpu_devices();
    assert_eq!(devices.len(), 2);
    assert!(devices.iter().all(|d| d.adopted));
    assert!(
        matches!(devices[0].state, GpuDeviceState::Lost { .. }),
        "{devices:?}"
    );
    assert!(devices[1].state.is_usable());
    assert_eq!(devices[0].in_use, 1, "the quarantined lease's sub-slot");
    // The engine hands a replacement over: the quarantine clears by the time the call answers.
    let Some((d2, q2, _)) = engine_device().await else {
        return;
    };
    sup.replace_device(0, d2.clone(), q2.clone()).await.unwrap();
    assert_eq!(
        sup.stats().quarantined,
        0,
        "the slot is back when replace_device answers"
    );
    let devices = sup.gpu_devices();
    assert_eq!(
        devices[0].generation, 2,
        "the engine's replacement is its second generation"
    );
    assert!(devices[0].state.is_usable());
    assert_eq!(devices[0].in_use, 0);
    // Both sub-slots serve again: two jobs held at once land on both devices.
    let placed = Arc::new(AtomicUsize::new(0));
    let (both_tx, both_rx) = tokio::sync::watch::channel(0usize);
    let jobs: Vec<_> = (0..2)
        .map(|i| {
            let (sup, placed, both_tx, mut both_rx) = (
                sup.clone(),
                Arc::clone(&placed),
                both_tx.clone(),
                both_rx.clone(),
            );
            tokio::spawn(async move {
                sup.run(
                    JobSpec::new(format!("after-{i}")).unwrap(),
                    move |ctx| async move {
                        let gpu = ctx.gpu().expect("a gpu slot").clone();
                        let device = gpu.device_index();
                        placed.fetch_or(1 << device, Ordering::SeqCst);
                        both_tx.send_modify(|n| *n += 1);
                        both_rx.wait_for(|n| *n == 2).await.unwrap();
                        let words = ctx
                            .spawn_blocking(move || fill_and_read(&gpu))
                            .await
                            .unwrap();
                        Ok::<_, std::io::Error>((device, words))
                    },
                )
                .await
            })
        })
        .collect();
    drop(both_rx);
    for job in jobs {
        let (_, words) = job.await.unwrap().unwrap();
        assert_eq!(words, [1, 3, 5, 7]);
    }
    assert_eq!(
        placed.load(Ordering::SeqCst),
        0b11,
        "one job on each device"
    );
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    broker.assert_quiescent(report.stats);
    // The replacement is still the engine's after shutdown.
    assert_eq!(engine_fill(&d2, &q2), [1, 3, 5, 7]);
}

/// A loss answered by the engine's callback: the replacement comes from it, with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_callback_can_hand_the_replacement_over_at_once() {
    let Some((d0, q0, i0)) = engine_device().await else {
        return;
    };
    let Some((d1, q1, _)) = engine_device().await else {
        return;
    };
    let asked: Arc<std::sync::Mutex<Vec<(usize, String)>>> = Arc::default();
    let spare = std::sync::Mutex::new(Some((d1, q1)));
    let record = Arc::clone(&asked);
    let opts = GpuOptions::new()
        .adopt(d0.clone(), q0, i0)
        .replacement_for_lost(move |index, reason| {
            record.lock().unwrap().push((index, reason.to_owned()));
            spare.lock().unwrap().take()
        });
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let (running_rx, lost_tx, victim) = hold(&sup, "victim");
    running_rx.await.unwrap();
    d0.destroy();
    let _ = d0.poll(wgpu::PollType::Poll);
    lost_tx.send(()).unwrap();
    assert_eq!(
        victim.await.unwrap().unwrap_err().code(),
        "LEASE_GPU_DEVICE_LOST"
    );
    // The only slot is quarantined until the callback's device is installed: this job waits
    // for it, then runs on it.
    assert_eq!(fill_job(&sup, "after").await.unwrap(), [1, 3, 5, 7]);
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 1, "asked once: {asked:?}");
    assert_eq!(asked[0].0, 0);
    assert!(!asked[0].1.is_empty(), "the loss comes with its reason");
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_device_refuses_what_it_cannot_replace() {
    let Some((sup, _device, _queue)) = adopted(1).await else {
        return;
    };
    let Some((d, q, _)) = engine_device().await else {
        return;
    };
    let err = sup
        .replace_device(7, d.clone(), q.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), "GPU_REPLACE_REFUSED", "{err}");
    sup.shutdown().await.unwrap();
    let err = sup.replace_device(0, d, q).await.unwrap_err();
    assert_eq!(err.code(), "GPU_REPLACE_REFUSED", "after shutdown: {err}");
    // A device leasehold opened itself is re-created by leasehold, not replaced.
    let Some(own) = start(Supervisor::builder(), GpuOptions::new()).await else {
        return;
    };
    let Some((d, q, _)) = engine_device().await else {
        return;
    };
    let err = own.replace_device(0, d, q).await.unwrap_err();
    assert_eq!(err.code(), "GPU_REPLACE_REFUSED", "{err}");
    own.shutdown().await.unwrap();
}

/// After `shutdown()`, the engine's device is neither destroyed nor lost: the engine keeps
/// using it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_device_still_works_after_shutdown() {
    let Some((sup, device, queue)) = adopted(1).await else {
        return;
    };
    assert_eq!(
        fill_job(&sup, "before-shutdown").await.unwrap(),
        [1, 3, 5, 7]
    );
    let report = sup.shutdown().await.unwrap();
    assert!(report.unclosed_devices.is_empty());
    drop(sup);
    assert_eq!(engine_fill(&device, &queue), [1, 3, 5, 7]);
}

/// A leased job writes a texture on the engine's device; once `run` answers (the release,
/// after the lease's fence), the engine samples it in its own pass: no copy through the CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_jobs_texture_is_read_by_the_engines_own_pass() {
    let Some((sup, device, queue)) = adopted(1).await else {
        return;
    };
    let texture = sup
        .run(JobSpec::new("tile").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().expect("a gpu slot").clone();
            let texture = gpu.device().create_texture(&wgpu::TextureDescriptor {
                label: Some("tile"),
                size: wgpu::Extent3d {
                    width: 64,
                    height: 1,
                    depth_or_array_layers: 1,
                },
                mip_level_count: 1,
                sample_count: 1,
                dimension: wgpu::TextureDimension::D2,
                format: wgpu::TextureFormat::R32Uint,
                usage: wgpu::TextureUsages::COPY_DST | wgpu::TextureUsages::TEXTURE_BINDING,
                view_formats: &[],
            });
            // On the GPU: fill the scratch (2i + 1), then copy it into the texture.
            let mut encoder = gpu.device().create_command_encoder(&Default::default());
            encoder.copy_buffer_to_texture(
                wgpu::TexelCopyBufferInfo {
                    buffer: &gpu.scratch().storage,
                    layout: wgpu::TexelCopyBufferLayout {
                        offset: 0,
                        bytes_per_row: Some(256),
                        rows_per_image: Some(1),
                    },
                },
                texture.as_image_copy(),
                wgpu::Extent3d {
                    width: 64,
                    height: 1,
                    depth_or_array_layers: 1,
                },
            );
            gpu.submit([dispatch(&gpu, "fill", 1), encoder.finish()]);
            Ok::<_, std::io::Error>(texture)
        })
        .await
        .unwrap();
    // The engine's pass: textureLoad into a buffer of its own, then read that buffer.
    let words = engine_sample(&device, &queue, &texture);
    let expected: Vec<u32> = (0..64).map(|i| 2 * i + 1 + 1000).collect();
    assert_eq!(words, expected);
    sup.shutdown().await.unwrap();
}

const ENGINE_SHADER: &str = r#"
@group(0) @binding(0) var tile: texture_2d<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn sample(@builtin(global_invocation_id) gid: vec3<u32>) {
    out[gid.x] = textureLoad(tile, vec2<u32>(gid.x, 0u), 0).x + 1000u;
}
"#;

/// The engine's compute pass over `tile`, read back through a buffer of its own.
fn engine_sample(device: &wgpu::Device, queue: &wgpu::Queue, tile: &wgpu::Texture) -> Vec<u32> {
    let pipeline = engine_pipeline(device, ENGINE_SHADER, "sample");
    let (out, readback) = engine_buffers(device);
    let view = tile.create_view(&Default::default());
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::TextureView(&view),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: out.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    encoder.copy_buffer_to_buffer(&out, 0, &readback, 0, 256);
    queue.submit([encoder.finish()]);
    read_mapped(device, &readback)
}

/// The engine's compute pipeline of `entry` in the WGSL `source`.
fn engine_pipeline(device: &wgpu::Device, source: &str, entry: &str) -> wgpu::ComputePipeline {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("engine"),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// Maps `buffer` (after every submission so far) and reads its words.
fn read_mapped(device: &wgpu::Device, buffer: &wgpu::Buffer) -> Vec<u32> {
    buffer.map_async(wgpu::MapMode::Read, .., |r| r.unwrap());
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let words = buffer
        .get_mapped_range(..)
        .unwrap()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    buffer.unmap();
    words
}

/// The engine's own compute pass of `entry` (the test shader) over `buffer`.
fn engine_pass(
    device: &wgpu::Device,
    buffer: &wgpu::Buffer,
    entry: &str,
    groups: u32,
) -> wgpu::CommandBuffer {
    let pipeline = engine_pipeline(device, gpu_support::SHADER, entry);
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: buffer.as_entire_binding(),
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

/// The engine's own 256-byte storage buffer, and a buffer to read it back through.
fn engine_buffers(device: &wgpu::Device) -> (wgpu::Buffer, wgpu::Buffer) {
    let buffer = |label, usage| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: 256,
            usage,
            mapped_at_creation: false,
        })
    };
    (
        buffer(
            "engine storage",
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        ),
        buffer(
            "engine readback",
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        ),
    )
}

/// The engine fills a buffer of its own on `device` and reads back its first 4 words.
fn engine_fill(device: &wgpu::Device, queue: &wgpu::Queue) -> Vec<u32> {
    let (buffer, readback) = engine_buffers(device);
    let mut encoder = device.create_command_encoder(&Default::default());
    encoder.copy_buffer_to_buffer(&buffer, 0, &readback, 0, 256);
    queue.submit([engine_pass(device, &buffer, "fill", 1), encoder.finish()]);
    read_mapped(device, &readback)[..4].to_vec()
}

/// An adopted device and one the supervisor opens itself (`max_devices(1)`) serve side by side:
/// the adopted one is device 0, leasehold's own comes after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_device_and_one_leasehold_opens_serve_side_by_side() {
    let Some((device, queue, info)) = engine_device().await else {
        return;
    };
    let opts = GpuOptions::new()
        .adopt(device.clone(), queue.clone(), info)
        .max_devices(1);
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    assert_eq!(sup.stats().capacity, Some(2), "one sub-slot on each device");
    let (both_tx, both_rx) = tokio::sync::watch::channel(0usize);
    let jobs: Vec<_> = (0..2)
        .map(|i| {
            let (sup, both_tx, mut both_rx, engine) = (
                sup.clone(),
                both_tx.clone(),
                both_rx.clone(),
                device.clone(),
            );
            tokio::spawn(async move {
                sup.run(
                    JobSpec::new(format!("side-{i}")).unwrap(),
                    move |ctx| async move {
                        let gpu = ctx.gpu().expect("a gpu slot").clone();
                        let on_engines = same_device(gpu.device(), &engine);
                        both_tx.send_modify(|n| *n += 1);
                        both_rx.wait_for(|n| *n == 2).await.unwrap();
                        let words = ctx
                            .spawn_blocking(move || fill_and_read(&gpu))
                            .await
                            .unwrap();
                        Ok::<_, std::io::Error>((
                            ctx.gpu().unwrap().device_index(),
                            on_engines,
                            words,
                        ))
                    },
                )
                .await
            })
        })
        .collect();
    drop(both_rx);
    let mut seen = Vec::new();
    for job in jobs {
        let (index, on_engines, words) = job.await.unwrap().unwrap();
        assert_eq!(words, [1, 3, 5, 7]);
        seen.push((index, on_engines));
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        [(0, true), (1, false)],
        "device 0 is the engine's, device 1 leasehold's"
    );
    let devices = sup.gpu_devices();
    assert_eq!(
        devices.iter().map(|d| d.adopted).collect::<Vec<_>>(),
        [true, false],
        "{devices:?}"
    );
    assert!(
        devices
            .iter()
            .all(|d| d.sub_slots == 1 && d.generation == 1)
    );
    let report = sup.shutdown().await.unwrap();
    assert!(report.unclosed_devices.is_empty());
    // leasehold's own device was destroyed at shutdown; the engine's still works.
    assert_eq!(engine_fill(&device, &queue), [1, 3, 5, 7]);
}

/// Whether a job's device is the engine's. wgpu compares devices by an id that is unique only
/// within one wgpu instance (leasehold's own devices come from instances of their own), so this
/// tells them apart by their limits instead: the test's engine requests wgpu's default limits,
/// leasehold its adapter's.
fn same_device(job: &wgpu::Device, engine: &wgpu::Device) -> bool {
    job == engine && job.limits() == engine.limits()
}

/// The engine's callback is code leasehold did not write: one that panics is caught, the
/// device's slot stays quarantined, and `replace_device` still brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_callback_that_panics_leaves_the_slot_quarantined_and_replaceable() {
    let Some((d0, q0, i0)) = engine_device().await else {
        return;
    };
    let asked = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&asked);
    let opts = GpuOptions::new()
        .adopt(d0.clone(), q0, i0)
        .replacement_for_lost(move |_, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            panic!("the engine's callback panicked")
        });
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let (running_rx, lost_tx, victim) = hold(&sup, "victim");
    running_rx.await.unwrap();
    d0.destroy();
    let _ = d0.poll(wgpu::PollType::Poll);
    lost_tx.send(()).unwrap();
    assert_eq!(
        victim.await.unwrap().unwrap_err().code(),
        "LEASE_GPU_DEVICE_LOST"
    );
    // The callback ran (and panicked) on its blocking thread; the supervisor still answers.
    tokio::time::timeout(std::time::Duration::from_secs(20), async {
        while asked.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the callback was asked");
    assert_eq!(sup.stats().quarantined, 1, "nothing replaced the device");
    let Some((d1, q1, _)) = engine_device().await else {
        return;
    };
    sup.replace_device(0, d1, q1).await.unwrap();
    assert_eq!(sup.stats().quarantined, 0);
    assert_eq!(fill_job(&sup, "after").await.unwrap(), [1, 3, 5, 7]);
    sup.shutdown().await.unwrap();
}

/// A job that submits `groups` workgroups of `long` through its lease, records when the GPU
/// says that work is done, tells the test, and returns once `go` is sent.
fn long_job_until(
    sup: &Supervisor,
    id: &str,
    groups: u32,
    done: Arc<AtomicBool>,
) -> (oneshot::Receiver<()>, oneshot::Sender<()>, Held) {
    let (submitted_tx, submitted_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let (sup, id) = (sup.clone(), id.to_owned());
    let job = tokio::spawn(async move {
        sup.run(JobSpec::new(id).unwrap(), move |ctx| async move {
            let gpu = ctx.gpu().expect("a gpu slot").clone();
            gpu.submit([dispatch(&gpu, "long", groups)]);
            gpu.queue()
                .on_submitted_work_done(move || done.store(true, Ordering::SeqCst));
            submitted_tx.send(()).unwrap();
            let _ = go_rx.await;
            Ok::<_, std::io::Error>(())
        })
        .await
    });
    (submitted_rx, go_tx, job)
}

/// The engine replaces a device that works (`replace_device` of a live device): the lease
/// running on the old device keeps its handles, its release waits for its work there (the
/// GPU's own completion signal has fired when `run` answers), and it ends well; new leases go
/// to the new device, and the old one is still the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_a_device_that_is_not_lost_lets_the_lease_on_it_finish_there() {
    let Some((sup, d0, q0)) = adopted(1).await else {
        return;
    };
    let work_done = Arc::new(AtomicBool::new(false));
    let (submitted, go, job) =
        long_job_until(&sup, "on-the-old-device", 1024, Arc::clone(&work_done));
    submitted.await.unwrap();
    // A replacement told apart from the old device by its limits.
    let limits = wgpu::Limits {
        max_bind_groups: 3,
        ..Default::default()
    };
    let Some((d1, q1, _)) = gpu_support::engine_device_limited(limits).await else {
        return;
    };
    sup.replace_device(0, d1.clone(), q1).await.unwrap();
    go.send(()).unwrap();
    job.await
        .unwrap()
        .expect("the lease on the replaced (working) device ends well");
    assert!(
        work_done.load(Ordering::SeqCst),
        "run answered before the lease's work on the old device had completed"
    );
    let devices = sup.gpu_devices();
    assert_eq!(devices[0].generation, 2, "{devices:?}");
    assert!(devices[0].state.is_usable(), "{devices:?}");
    let on_new = sup
        .run(
            JobSpec::new("on-the-new-device").unwrap(),
            move |ctx| async move {
                let gpu = ctx.gpu().expect("a gpu slot").clone();
                let on_new = gpu.device().limits().max_bind_groups == 3;
                let words = ctx
                    .spawn_blocking(move || fill_and_read(&gpu))
                    .await
                    .unwrap();
                Ok::<_, std::io::Error>((on_new, words))
            },
        )
        .await
        .unwrap();
    assert_eq!(on_new, (true, vec![1, 3, 5, 7]));
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
    // The old device was neither destroyed nor drained by leasehold: the engine still uses it.
    assert_eq!(engine_fill(&d0, &q0), [1, 3, 5, 7]);
}

/// `replace_device` refuses a device that cannot hold the slots' scratch (its limits are too
/// small); that refused device leaves no trace: when the engine later destroys it, the device
/// installed since is not marked lost, and leases keep running on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_replacement_leaves_no_trace_on_the_device_it_refused() {
    let Some((sup, _d0, _q0)) = adopted(1).await else {
        return;
    };
    let small = wgpu::Limits {
        max_buffer_size: 1024,
        ..Default::default()
    };
    let Some((refused, refused_queue, _)) = gpu_support::engine_device_limited(small).await else {
        return;
    };
    let err = sup
        .replace_device(0, refused.clone(), refused_queue.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), "GPU_UNAVAILABLE", "{err}");
    assert_eq!(sup.gpu_devices()[0].generation, 1, "nothing was installed");
    let Some((good, good_queue, _)) = engine_device().await else {
        return;
    };
    sup.replace_device(0, good, good_queue).await.unwrap();
    // The engine is done with the device it could not hand over.
    refused.destroy();
    let _ = refused.poll(wgpu::PollType::Poll);
    let devices = sup.gpu_devices();
    assert!(
        devices[0].state.is_usable(),
        "destroying the refused device marked the installed one lost: {devices:?}"
    );
    assert_eq!(fill_job(&sup, "after").await.unwrap(), [1, 3, 5, 7]);
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

/// A replacement from another adapter (here: another backend, Vulkan for GL or GL for Vulkan)
/// is reported as what it is: jobs see its adapter info, and so does `gpu_devices()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_from_another_backend_reports_its_own_adapter() {
    let Some((sup, d0, _q0)) = adopted(1).await else {
        return;
    };
    let first = d0.adapter_info().backend;
    let other = if first == wgpu::Backend::Gl {
        wgpu::Backends::VULKAN
    } else {
        wgpu::Backends::GL
    };
    let Some((d1, q1, i1)) = gpu_support::engine_device_with(other, wgpu::Limits::default()).await
    else {
        return;
    };
    assert_ne!(i1.backend, first);
    sup.replace_device(0, d1, q1).await.unwrap();
    let (seen, words) = sup
        .run(JobSpec::new("where").unwrap(), |ctx| async move {
            let gpu = ctx.gpu().expect("a gpu slot").clone();
            let seen = gpu.adapter_info().clone();
            let words = ctx
                .spawn_blocking(move || fill_and_read(&gpu))
                .await
                .unwrap();
            Ok::<_, std::io::Error>((seen, words))
        })
        .await
        .unwrap();
    assert_eq!(words, [1, 3, 5, 7]);
    assert_eq!(seen.backend, i1.backend, "the job's adapter info: {seen:?}");
    assert_eq!(seen.name, i1.name);
    let devices = sup.gpu_devices();
    assert_eq!(
        devices[0].backend,
        format!("{:?}", i1.backend),
        "{devices:?}"
    );
    assert_eq!(devices[0].adapter, i1.name, "{devices:?}");
    sup.shutdown().await.unwrap();
}

/// With `FencePolicy::Recorded`, a lease that used its scratch waits for its own submissions
/// only. Its release submits nothing on the shared queue (the scratch was cleared when the job
/// took it, ordered before the job's own work) and waits for the job's last submission: seen
/// through the backend hook, on every backend. Where the backend runs submissions
/// asynchronously (Vulkan), the engine's frame, submitted after the job's work, is still
/// running when `run` answers (its completion callback has not fired, after a poll). On GL,
/// wgpu runs a submission inside `queue.submit`, under the device's submission lock: the
/// engine's frame has completed before its submit returns, so only the first half can be seen
/// there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_fence_waits_for_the_jobs_own_work_and_not_the_engines_later_frame() {
    let Some((device, queue, info)) = engine_device().await else {
        return;
    };
    let log = EventLog::default();
    let calls = log.clone();
    let opts = GpuOptions::new()
        .adopt(device.clone(), queue.clone(), info)
        .fence_policy(leasehold::FencePolicy::Recorded)
        .backend_hook(move |call, _device, _sub| {
            if matches!(
                call,
                BackendCall::ZeroScratch | BackendCall::FenceSubmit | BackendCall::FenceWait
            ) {
                calls.push(format!("{call:?}"));
            }
        });
    let Some(sup) = start(Supervisor::builder(), opts).await else {
        return;
    };
    let own_done = Arc::new(AtomicBool::new(false));
    let frame_done = Arc::new(AtomicBool::new(false));
    let (submitted_tx, submitted_rx) = std::sync::mpsc::channel::<()>();
    let (frame_tx, frame_rx) = oneshot::channel::<bool>();
    // The engine's thread: once the job has submitted, one long frame on the shared queue.
    let engine = {
        let (device, queue, frame_done) = (device.clone(), queue.clone(), Arc::clone(&frame_done));
        std::thread::spawn(move || {
            let buffer = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("engine"),
                size: 4 * (4096 * 64 + 1),
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            });
            let frame = engine_pass(&device, &buffer, "long", 4096);
            submitted_rx.recv().unwrap();
            queue.submit([frame]);
            let done = Arc::clone(&frame_done);
            queue.on_submitted_work_done(move || done.store(true, Ordering::SeqCst));
            let _ = device.poll(wgpu::PollType::Poll);
            // Still running after its submission returned: the backend runs work
            // asynchronously.
            let asynchronous = !frame_done.load(Ordering::SeqCst);
            frame_tx.send(asynchronous).unwrap();
        })
    };
    let (own, job_log) = (Arc::clone(&own_done), log.clone());
    let asynchronous = sup
        .run(
            JobSpec::new("own-work-only").unwrap(),
            move |ctx| async move {
                let gpu = ctx.gpu().expect("a gpu slot").clone();
                gpu.submit([dispatch(&gpu, "fill", 1)]);
                gpu.queue()
                    .on_submitted_work_done(move || own.store(true, Ordering::SeqCst));
                submitted_tx.send(()).unwrap();
                let asynchronous = frame_rx.await.unwrap();
                job_log.push("job-end");
                Ok::<_, std::io::Error>(asynchronous)
            },
        )
        .await
        .unwrap();
    let _ = device.poll(wgpu::PollType::Poll);
    let frame_done_at_answer = frame_done.load(Ordering::SeqCst);
    engine.join().unwrap();
    let events = log.events();
    let release: Vec<&String> = events[log.position("job-end") + 1..].iter().collect();
    assert_eq!(
        release,
        ["FenceWait"],
        "the release waits for the job's own work and submits nothing: {events:?}"
    );
    assert!(
        own_done.load(Ordering::SeqCst),
        "run answered before the job's own work completed"
    );
    if asynchronous {
        assert!(
            !frame_done_at_answer,
            "run answered only after the engine's later frame had completed"
        );
    } else {
        eprintln!(
            "the backend ran the engine's frame inside its submission: its order against the \
             release cannot be seen here"
        );
    }
    sup.shutdown().await.unwrap();
}

/// No replacement will come from leasehold for an adopted device: `shutdown` does not wait for
/// a slot quarantined on a lost one (the shutdown bound here is an hour), and reports it as
/// quarantined. While quarantined, the slot counts in `quarantined`, not in `active`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_a_slot_quarantined_on_a_lost_adopted_device() {
    let Some((d0, q0, i0)) = engine_device().await else {
        return;
    };
    let opts = GpuOptions::new().adopt(d0.clone(), q0, i0);
    let builder = Supervisor::builder().shutdown_timeout(std::time::Duration::from_secs(3600));
    let Some(sup) = start(builder, opts).await else {
        return;
    };
    let (running_rx, lost_tx, victim) = hold(&sup, "victim");
    running_rx.await.unwrap();
    d0.destroy();
    let _ = d0.poll(wgpu::PollType::Poll);
    lost_tx.send(()).unwrap();
    assert_eq!(
        victim.await.unwrap().unwrap_err().code(),
        "LEASE_GPU_DEVICE_LOST"
    );
    let stats = sup.stats();
    assert_eq!((stats.quarantined, stats.active), (1, 0), "{stats:?}");
    let started = std::time::Instant::now();
    let report = tokio::time::timeout(std::time::Duration::from_secs(120), sup.shutdown())
        .await
        .expect("shutdown waited for a slot on a lost adopted device")
        .unwrap();
    eprintln!("shutdown took {:?}", started.elapsed());
    assert_eq!(report.quarantined, 1, "{report:?}");
    assert!(
        report.unproven[0].reason.contains("lost"),
        "{:?}",
        report.unproven
    );
}
