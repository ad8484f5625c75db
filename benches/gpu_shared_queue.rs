//! A lease's cost on a device the engine shares with leasehold (`GpuOptions::adopt`): `run`
//! with a body that submits one small dispatch through its slot (`fill`), its release fenced on
//! the queue the engine renders with, next to the same while an engine loop at 60 Hz submits a
//! frame's compute work (`frame`: about 2 ms on lavapipe) to that queue (see `BENCHMARKS.md`).
//!
//! - `quiet`: the engine submits nothing (the floor);
//! - `engine_60hz`: the engine's frame loop runs on its own thread: every 16.7 ms one dispatch
//!   of `frame`, then a non-blocking poll, as a renderer would;
//! - `engine_60hz_recorded`: the same with `FencePolicy::Recorded` (the release waits only for
//!   the job's own submissions; the queue still runs them after the engine's work queued before).
//!
//! With `FencePolicy::Queue` a release waits for everything queued before its fence, the
//! engine's frame included; the ratio says what that adds per lease. criterion ids are
//! `gpu_shared_queue/<function>/fill`; `summary` prints the ratios. Without an adapter it prints
//! a loud skip (a panic under `LEASEHOLD_REQUIRE_GPU=1`).

#![cfg_attr(not(feature = "gpu"), allow(dead_code, unused_imports))]

mod floor;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

use floor::{key, ratio_row, table_end, table_start, timed};

const GROUP: &str = "gpu_shared_queue";
const PARAM: &str = "fill";
const SAMPLES: usize = 20;
/// Workgroups of the engine's frame dispatch (about 2 ms on lavapipe with 2 cores).
const FRAME_GROUPS: u32 = 16;
const FRAME: Duration = Duration::from_nanos(16_666_667);

const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;

@compute @workgroup_size(64)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>) {
    data[gid.x] = gid.x * 2u + 1u;
}

@compute @workgroup_size(64)
fn frame(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < 4000u; i = i + 1u) {
        x = x * 1664525u + 1013904223u;
    }
    data[gid.x] = x;
}
"#;

#[cfg(feature = "gpu")]
mod shared {
    use super::*;
    use leasehold::{FencePolicy, GpuOptions, JobGpu, JobSpec, Supervisor, wgpu};

    /// One compute dispatch of `entry` over `buffer`.
    fn dispatch(
        device: &wgpu::Device,
        pipeline: &wgpu::ComputePipeline,
        buffer: &wgpu::Buffer,
        groups: u32,
    ) -> wgpu::CommandBuffer {
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
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
        encoder.finish()
    }

    pub fn pipeline(device: &wgpu::Device, entry: &str) -> wgpu::ComputePipeline {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("bench"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
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

    /// The engine: its device and queue, and a 60 Hz frame loop that runs while `on` is set.
    pub struct Engine {
        pub device: wgpu::Device,
        pub queue: wgpu::Queue,
        pub info: wgpu::AdapterInfo,
        pub on: Arc<AtomicBool>,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<u64>>,
    }

    impl Engine {
        pub fn new() -> Option<Self> {
            // Vulkan alone first, GL in an instance of its own only without a Vulkan adapter
            // (docs/gpu.md, "Backends").
            let adapter_on = |backends| {
                let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
                desc.backends = backends;
                futures_executor(
                    wgpu::Instance::new(desc)
                        .request_adapter(&wgpu::RequestAdapterOptions::default()),
                )
            };
            let found = match wgpu::Backends::from_env() {
                Some(named) => adapter_on(named),
                None => {
                    adapter_on(wgpu::Backends::VULKAN).or_else(|_| adapter_on(wgpu::Backends::GL))
                }
            };
            let adapter = match found {
                Ok(a) => a,
                Err(e) => {
                    assert_ne!(
                        std::env::var("LEASEHOLD_REQUIRE_GPU").as_deref(),
                        Ok("1"),
                        "LEASEHOLD_REQUIRE_GPU=1 but no GPU adapter: {e}"
                    );
                    eprintln!("\n*** SKIPPED gpu_shared_queue: no GPU adapter ({e}) ***\n");
                    return None;
                }
            };
            let (device, queue) = futures_executor(adapter.request_device(&Default::default()))
                .expect("the engine's device");
            let (on, stop) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let thread = {
                let (device, queue, on, stop) = (
                    device.clone(),
                    queue.clone(),
                    Arc::clone(&on),
                    Arc::clone(&stop),
                );
                std::thread::spawn(move || {
                    let frame = pipeline(&device, "frame");
                    let target = device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("engine frame"),
                        size: 4 * 64 * u64::from(FRAME_GROUPS),
                        usage: wgpu::BufferUsages::STORAGE,
                        mapped_at_creation: false,
                    });
                    let mut frames = 0;
                    let mut next = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        if on.load(Ordering::Relaxed) {
                            queue.submit([dispatch(&device, &frame, &target, FRAME_GROUPS)]);
                            let _ = device.poll(wgpu::PollType::Poll);
                            frames += 1;
                        }
                        next += FRAME;
                        std::thread::sleep(next.saturating_duration_since(Instant::now()));
                    }
                    frames
                })
            };
            Some(Self {
                info: adapter.get_info(),
                device,
                queue,
                on,
                stop,
                thread: Some(thread),
            })
        }

        /// Stops the loop; the frames it submitted.
        pub fn stop(mut self) -> u64 {
            self.stop.store(true, Ordering::Relaxed);
            self.thread
                .take()
                .map_or(0, |t| t.join().expect("engine loop"))
        }
    }

    /// Drives a future on this thread (the engine's set-up, before any runtime).
    fn futures_executor<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    pub async fn start(engine: &Engine, fence: FencePolicy) -> Supervisor {
        let opts = GpuOptions::new()
            .adopt(
                engine.device.clone(),
                engine.queue.clone(),
                engine.info.clone(),
            )
            .fence_policy(fence);
        Supervisor::builder()
            .gpu(opts)
            .start()
            .await
            .expect("supervisor on the engine's device")
    }

    /// `n` runs, one after another, each one `fill` dispatch through its slot (`fill` is a
    /// pipeline on the engine's device, made once).
    pub async fn runs(sup: &Supervisor, fill: &wgpu::ComputePipeline, n: u64) -> Duration {
        let start = Instant::now();
        for _ in 0..n {
            let fill = fill.clone();
            sup.run(JobSpec::new("tile").unwrap(), |ctx| async move {
                let gpu: JobGpu = ctx.gpu().expect("a gpu slot").clone();
                gpu.submit([dispatch(gpu.device(), &fill, &gpu.scratch().storage, 1)]);
                Ok::<_, std::io::Error>(())
            })
            .await
            .expect("run");
        }
        start.elapsed()
    }
}

#[cfg(feature = "gpu")]
fn gpu_shared_queue(c: &mut Criterion) {
    use leasehold::FencePolicy;
    let Some(engine) = shared::Engine::new() else {
        return;
    };
    let rt = floor::runtime();
    let fill = shared::pipeline(&engine.device, "fill");
    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(SAMPLES)
        .throughput(Throughput::Elements(1));
    floor::times(
        &mut group,
        Duration::from_millis(500),
        Duration::from_secs(3),
    );
    for (function, fence, loop_on) in [
        ("quiet", FencePolicy::Queue, false),
        ("engine_60hz", FencePolicy::Queue, true),
        ("engine_60hz_recorded", FencePolicy::Recorded, true),
    ] {
        let sup = rt.block_on(shared::start(&engine, fence));
        engine.on.store(loop_on, Ordering::Relaxed);
        let k = key(GROUP, function, PARAM);
        group.bench_function(BenchmarkId::new(function, PARAM), |b| {
            timed(b, &rt, &k, SAMPLES, |iters| {
                let (sup, fill) = (sup.clone(), fill.clone());
                async move { shared::runs(&sup, &fill, iters).await }
            });
        });
        engine.on.store(false, Ordering::Relaxed);
        rt.block_on(async { sup.shutdown().await.expect("shutdown") });
    }
    group.finish();
    let frames = engine.stop();
    println!("\n(the engine's loop submitted {frames} frames while it was on)");
}

#[cfg(not(feature = "gpu"))]
fn gpu_shared_queue(_c: &mut Criterion) {
    eprintln!("gpu_shared_queue needs the `gpu` feature");
}

fn summary(_c: &mut Criterion) {
    if !table_start("on the engine's device", "per run") {
        return;
    }
    let k = |f: &str| key(GROUP, f, PARAM);
    ratio_row(
        "run, engine at 60 Hz on the same queue / quiet queue",
        &k("engine_60hz"),
        &k("quiet"),
        1,
        None,
    );
    ratio_row(
        "run, engine at 60 Hz, FencePolicy::Recorded / quiet queue",
        &k("engine_60hz_recorded"),
        &k("quiet"),
        1,
        None,
    );
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = gpu_shared_queue, summary
}
criterion_main!(benches);
