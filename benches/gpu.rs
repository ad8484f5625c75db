//! GPU benchmarks: slot-gated GPU jobs next to a fair floor measured in the same run, so that
//! the report is a ratio (see `BENCHMARKS.md`, "GPU slots").
//!
//! One batch is `JOBS` jobs, each a compute dispatch over a 1 MiB buffer that is *fenced*:
//! waited for before the job counts as done and its buffer may serve the next job. The batch runs
//! at a concurrency of `SLOTS`:
//!
//! - `direct_fenced` (the floor): the jobs submitted straight on the supervisor's own device and
//!   queue, by `SLOTS` streams (tokio tasks, each with a buffer of its own) that run their share
//!   of the batch one job after another. Per job, on tokio's blocking pool: a bind group, one
//!   dispatch, a submission, and a blocking wait for that submission — the job's fence.
//! - `leasehold_run`: the floor's job under a GPU slot. `JOBS` `Supervisor::run` calls spawned at
//!   once on a supervisor with one device and `SLOTS` sub-slots (`slots_per_device(SLOTS)`),
//!   defaults otherwise (`FencePolicy::Queue`, `ScratchPolicy::Zeroed`). The body makes the same
//!   bind group and dispatch on the floor's buffer of its slot (`ctx.slot_id()`: no two jobs
//!   that run at once share one) and submits it through its context (`gpu.submit`); its fence
//!   is leasehold's release fence. The job counts as done when `run` returns, after the whole
//!   release pipeline. This is the target's row: what a GPU slot costs a job that does what
//!   the floor does.
//! - `leasehold_run_scratch`: the same on the same supervisor, on the slot's scratch buffer
//!   (`gpu.scratch().storage`), which leasehold clears when the job takes it (2 × 1 MiB): its
//!   difference to `leasehold_run` is what isolation between leases costs a job that uses its
//!   scratch.
//! - `leasehold_run_scratch_reused`: the scratch job with `ScratchPolicy::Reused` (taken, never
//!   cleared): its difference to `leasehold_run_scratch` is the clear itself.
//! - `leasehold_run_recorded_fence`: `leasehold_run` with `FencePolicy::Recorded` (context).
//! - `leasehold_run_without_gpu_slot`: a supervisor without `.gpu(..)` (`.slots(SLOTS)`) whose
//!   jobs do exactly the floor's job, its blocking wait included (on the floor's device, queue
//!   and buffer of their slot, the wait in `ctx.spawn_blocking`): what leasehold's job
//!   lifecycle costs without its GPU slot. `leasehold_run` − this row is the GPU slot's own
//!   share (the checkout, and the release fence instead of the job's own wait).
//! - `direct_polled`: the floor with a busy-polling fence (non-blocking polls until the queue's
//!   work-done callback fires) instead of the blocking wait (context: on a hardware GPU a
//!   blocking wait issued while the work still runs pays the driver's wake-up latency).
//!
//! Next to the ratios, what noise does not move: per job, the calls into the GPU backend each
//! side made (submissions: the job's, scratch clears, the fence's own; blocking waits; polls),
//! counted by a backend hook on leasehold's side and by construction on the floor's, and the
//! process's CPU time per job (all threads, the adapter's included: on a software adapter the
//! GPU work is CPU work), both over the paired rounds.
//!
//! Two work sizes: `fill` (next to no GPU work) and `spin` (about 3 ms per job on lavapipe with
//! 2 cores; `LEASEHOLD_BENCH_SPIN_STEPS=N` sets its LCG steps per invocation, and
//! `LEASEHOLD_BENCH_SPIN_MS=3` calibrates them to about 3 ms per job on the adapter at hand;
//! the table prints the per-job time it came to). The last "benchmark", `summary`, prints the
//! ratio table from the samples criterion took above. `cargo bench --bench gpu -- --test` (CI)
//! runs every benchmark once and prints the table labelled as such. Without an adapter the
//! suite prints a loud skip line and measures nothing, unless `LEASEHOLD_REQUIRE_GPU=1` (CI),
//! which makes that a panic. `WGPU_BACKEND` picks the backend (`WGPU_BACKEND=gl` for GL).
//!
//! Every figure is taken on a worker thread of a 2-worker multi-thread runtime: each routine
//! spawns its timed loop onto the runtime and returns the time the loop measured itself
//! (`iter_custom`), as in the other benches (`benches/floor/mod.rs`).

#![cfg_attr(not(feature = "gpu"), allow(dead_code, unused_imports))]

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::runtime::Runtime;

const GROUP: &str = "gpu";
const FLOOR: &str = "direct_fenced";
const LEASEHOLD: &str = "leasehold_run";
const LEASEHOLD_SCRATCH: &str = "leasehold_run_scratch";
const LEASEHOLD_REUSED: &str = "leasehold_run_scratch_reused";
const LEASEHOLD_RECORDED: &str = "leasehold_run_recorded_fence";
const LEASEHOLD_NO_GPU: &str = "leasehold_run_without_gpu_slot";
const FLOOR_POLLED: &str = "direct_polled";
/// Slot-gated throughput ≥ 0.9× the floor's, i.e. time ≤ 1/0.9 of it.
const TARGET_THROUGHPUT: f64 = 0.9;
/// GPU slots (one device, that many sub-slots) and floor streams.
const SLOTS: u32 = 2;
/// Jobs per batch (one iteration).
const JOBS: usize = 32;
const SAMPLES: usize = 20;
/// The GPU work of one job: `(entry point, workgroups)`.
const WORK: [(&str, u32); 2] = [("fill", 4), ("spin", 64)];
/// Bytes of each floor stream's buffer (leasehold's default scratch size, of each of a slot's
/// two scratch buffers).
const SCRATCH: u64 = 1 << 20;
/// LCG steps per invocation of `spin` (default 2000: about 3 ms per job on lavapipe with 2
/// cores). A hardware GPU needs far more for ~3 ms jobs (the table prints the per-job time).
const SPIN_STEPS_ENV: &str = "LEASEHOLD_BENCH_SPIN_STEPS";
const SPIN_STEPS_DEFAULT: u32 = 2000;
/// Set to `1` (CI does) to make a missing GPU adapter a failure instead of a skip.
const REQUIRE_GPU_ENV: &str = "LEASEHOLD_REQUIRE_GPU";

const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;

// 256 invocations, one store each: the dispatch itself is next to nothing.
@compute @workgroup_size(64)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>) {
    data[gid.x] = gid.x * 2u + 1u;
}

// 4096 invocations, SPIN_STEPS (see `spin_steps`) LCG steps each.
@compute @workgroup_size(64)
fn spin(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < SPIN_STEPSu; i = i + 1u) {
        x = x * 1664525u + 1013904223u;
    }
    data[gid.x] = x;
}
"#;

/// Or: calibrate `spin` to this many milliseconds per job on the floor's device (one job
/// alone, fenced), before anything is timed.
const SPIN_MS_ENV: &str = "LEASEHOLD_BENCH_SPIN_MS";

/// `spin`'s steps per invocation, once chosen (0: not yet).
static SPIN_STEPS: AtomicU32 = AtomicU32::new(0);

/// `spin`'s steps per invocation: calibrated, else `LEASEHOLD_BENCH_SPIN_STEPS`, else 2000.
fn spin_steps() -> u32 {
    match SPIN_STEPS.load(Relaxed) {
        0 => std::env::var(SPIN_STEPS_ENV)
            .ok()
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|e| panic!("{SPIN_STEPS_ENV}={v:?} is not a step count: {e}"))
            })
            .unwrap_or(SPIN_STEPS_DEFAULT),
        steps => steps,
    }
}

/// The per-job time `spin` is to be calibrated to, if asked.
fn spin_target() -> Option<Duration> {
    let v = std::env::var(SPIN_MS_ENV).ok()?;
    let ms: f64 = v
        .parse()
        .unwrap_or_else(|e| panic!("{SPIN_MS_ENV}={v:?} is not milliseconds: {e}"));
    Some(Duration::from_secs_f64(ms / 1e3))
}

/// The bench's WGSL, with `spin`'s step count filled in.
fn shader(steps: u32) -> String {
    SHADER.replace("SPIN_STEPS", &steps.to_string())
}

// ---------------------------------------------------------------------------------------------
// Samples, for the ratio table
// ---------------------------------------------------------------------------------------------

/// Per-iteration times (ns) of the last `SAMPLES` routine calls of each benchmark: in benchmark
/// mode criterion calls the routine `sample_size` times after its warm-up, so these are exactly
/// its samples, and their median is criterion's median.
static SAMPLES_NS: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Batch times (ns) of the paired rounds, per benchmark key, in round order.
static PAIRED_NS: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Rounds of the paired measurement (one in test mode).
const PAIRED_ROUNDS: usize = 31;

/// The adapter the figures were taken on, for the table's heading.
static ADAPTER: Mutex<Option<String>> = Mutex::new(None);

/// The calls into the GPU backend a side makes, counted per kind: a job's submission through its
/// context, a scratch clear (a submission), the fence's own empty submission, the fence's
/// blocking wait, the fence's non-blocking poll.
const CALL_KINDS: [&str; 5] = ["job submit", "clear", "fence submit", "wait", "poll"];

/// What the paired rounds counted, per benchmark key, summed over the rounds: jobs, backend
/// calls per kind (`None`: not counted by a hook; the floors', known by construction), and the
/// process's CPU time.
#[derive(Debug, Clone, Default)]
struct Counted {
    jobs: u64,
    calls: Option<[u64; CALL_KINDS.len()]>,
    cpu: Duration,
}

static COUNTED: Mutex<BTreeMap<String, Counted>> = Mutex::new(BTreeMap::new());

/// The CPU time of the whole process so far: every thread, the software adapter's too, those
/// that have ended included (`CLOCK_PROCESS_CPUTIME_ID`); `None` off 64-bit Linux.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn cpu_time() -> Option<Duration> {
    /// `struct timespec` on 64-bit Linux.
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
    let mut t = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable `struct timespec` for the call's whole duration, and
    // the clock id is one Linux defines.
    let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    (rc == 0).then(|| Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn cpu_time() -> Option<Duration> {
    None
}

fn record(key: &str, iters: u64, elapsed: Duration) {
    let mut samples = SAMPLES_NS.lock().expect("samples lock");
    let series = samples.entry(key.to_owned()).or_default();
    series.push(elapsed.as_nanos() as f64 / iters.max(1) as f64);
    if series.len() > SAMPLES {
        series.remove(0);
    }
}

fn median(key: &str) -> Option<f64> {
    let samples = SAMPLES_NS.lock().expect("samples lock");
    median_of(samples.get(key)?.clone())
}

/// The median of the per-round ratios `floor / side` of the paired rounds.
fn paired_ratio(side: &str, work: &str) -> Option<f64> {
    let paired = PAIRED_NS.lock().expect("paired lock");
    let (floor, side) = (
        paired.get(&key(FLOOR, work))?,
        paired.get(&key(side, work))?,
    );
    median_of(floor.iter().zip(side).map(|(f, s)| f / s).collect())
}

fn median_of(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

fn key(function: &str, work: &str) -> String {
    format!("{GROUP}/{function}/jobs={JOBS},slots={SLOTS},work={work}")
}

fn test_mode() -> bool {
    std::env::args().any(|a| a == "--test")
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Runs a timed loop on a runtime worker and records it.
fn timed<F, Fut>(b: &mut criterion::Bencher<'_>, rt: &Runtime, key: &str, make: F)
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Duration> + Send + 'static,
{
    b.to_async(rt).iter_custom(|iters| {
        let run = tokio::spawn(make(iters));
        async move {
            let elapsed = run.await.expect("timed loop panicked");
            record(key, iters, elapsed);
            elapsed
        }
    });
}

/// Job temp dirs on tmpfs when the machine has one (the figures are then the library's and not
/// the disk's; `LEASEHOLD_BENCH_ROOT` picks another place), as in `benches/floor/mod.rs`.
fn scratch_dir() -> tempfile::TempDir {
    let make = |base: &Path| {
        tempfile::Builder::new()
            .prefix("leasehold-gpu-bench-")
            .tempdir_in(base)
            .ok()
    };
    std::env::var_os("LEASEHOLD_BENCH_ROOT")
        .and_then(|base| make(Path::new(&base)))
        .or_else(|| make(Path::new("/dev/shm")))
        .or_else(|| make(&std::env::temp_dir()))
        .expect("a writable scratch dir")
}

// ---------------------------------------------------------------------------------------------
// The jobs
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "gpu")]
mod jobs {
    use super::*;
    use leasehold::{
        BackendCall, FencePolicy, GpuError, GpuOptions, JobSpec, ScratchPolicy, StartError,
        Supervisor, wgpu,
    };
    use std::sync::atomic::AtomicU64;

    /// A compute pipeline built once per device, before any timing, and used by every job on it.
    pub(crate) struct Kernel {
        device: wgpu::Device,
        pipeline: wgpu::ComputePipeline,
        groups: u32,
    }

    impl Kernel {
        pub(crate) fn new(device: &wgpu::Device, entry: &str, groups: u32) -> Self {
            Self::with_steps(device, entry, groups, spin_steps())
        }

        fn with_steps(device: &wgpu::Device, entry: &str, groups: u32, steps: u32) -> Self {
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("bench"),
                source: wgpu::ShaderSource::Wgsl(shader(steps).into()),
            });
            let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
            Self {
                device: device.clone(),
                pipeline,
                groups,
            }
        }

        /// One job's command buffer: a bind group for `buffer` (made per job on every side, as
        /// a job handed whichever slot is free would) and one dispatch.
        fn encode(&self, buffer: &wgpu::Buffer) -> wgpu::CommandBuffer {
            let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &self.pipeline.get_bind_group_layout(0),
                entries: &[wgpu::BindGroupEntry {
                    binding: 0,
                    resource: buffer.as_entire_binding(),
                }],
            });
            let mut encoder = self.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(&self.pipeline);
                pass.set_bind_group(0, &bind, &[]);
                pass.dispatch_workgroups(self.groups, 1, 1);
            }
            encoder.finish()
        }

        /// The floor's job with a busy-polling fence: submitted, then non-blocking polls until
        /// the queue says the work is done (burns a core; context only).
        fn run_polled(&self, queue: &wgpu::Queue, buffer: &wgpu::Buffer) {
            queue.submit([self.encode(buffer)]);
            let done = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&done);
            queue.on_submitted_work_done(move || flag.store(true, Release));
            while !done.load(Acquire) {
                self.device
                    .poll(wgpu::PollType::Poll)
                    .expect("the GPU work completes");
                std::hint::spin_loop();
            }
        }

        /// The floor's job: the command buffer, submitted, and a blocking wait for it.
        fn run_fenced(&self, queue: &wgpu::Queue, buffer: &wgpu::Buffer) {
            let index = queue.submit([self.encode(buffer)]);
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(index),
                    timeout: None,
                })
                .expect("the GPU work completes");
        }
    }

    /// The calls into the GPU backend a supervisor made, per kind of [`CALL_KINDS`] (its
    /// backend hook counts them).
    pub(crate) type Calls = Arc<[AtomicU64; CALL_KINDS.len()]>;

    fn snapshot(calls: &Calls) -> [u64; CALL_KINDS.len()] {
        std::array::from_fn(|i| calls[i].load(Relaxed))
    }

    /// A supervisor on the first adapter, `SLOTS` sub-slots, counting its backend calls, or a
    /// loud skip (a panic when CI requires a GPU).
    pub(crate) async fn start(
        work_root: &Path,
        fence: FencePolicy,
        scratch: ScratchPolicy,
    ) -> Option<(Supervisor, Calls)> {
        let calls: Calls = Arc::new(std::array::from_fn(|_| AtomicU64::new(0)));
        let counts = Arc::clone(&calls);
        let started = Supervisor::builder()
            .work_root(work_root)
            .gpu(
                GpuOptions::new()
                    .slots_per_device(SLOTS)
                    .fence_policy(fence)
                    .scratch_policy(scratch)
                    .backend_hook(move |call, _device, _sub| {
                        let kind = match call {
                            BackendCall::Submit => 0,
                            BackendCall::ZeroScratch => 1,
                            BackendCall::FenceSubmit => 2,
                            BackendCall::FenceWait => 3,
                            BackendCall::FencePoll => 4,
                            _ => return,
                        };
                        counts[kind].fetch_add(1, Relaxed);
                    }),
            )
            .start()
            .await;
        match started {
            Ok(sup) => Some((sup, calls)),
            Err(StartError::Gpu(GpuError::NoAdapter)) => {
                assert_ne!(
                    std::env::var(REQUIRE_GPU_ENV).as_deref(),
                    Ok("1"),
                    "{REQUIRE_GPU_ENV}=1 but no GPU adapter was found"
                );
                eprintln!(
                    "\n*** SKIPPED gpu benchmarks: no GPU adapter on this machine; install Mesa \
                     (libegl1 libgl1-mesa-dri for GL, mesa-vulkan-drivers libvulkan1 for Vulkan) ***\n"
                );
                None
            }
            Err(e) => panic!("could not start a supervisor on a GPU: {e:?}"),
        }
    }

    /// The floor's resources: a supervisor's device and queue, one buffer per stream (or slot).
    #[derive(Clone)]
    pub(crate) struct Direct {
        queue: wgpu::Queue,
        buffers: Arc<Vec<wgpu::Buffer>>,
    }

    /// What a leasehold job does with its slot.
    #[derive(Clone)]
    pub(crate) enum Job {
        /// The floor's job on the buffer of its slot (`ctx.slot_id()`), on the slot's device.
        OwnBuffer(Direct),
        /// The same dispatch on the slot's scratch storage buffer.
        Scratch,
    }

    /// One side of the comparison, ready to run batches.
    #[derive(Clone)]
    pub(crate) enum Side {
        /// A supervisor with GPU slots; the body submits through its context, leasehold fences.
        Leasehold(Supervisor, Job, Calls),
        /// A supervisor without GPU slots; the body does the floor's job on its slot's buffer.
        WithoutGpuSlot(Supervisor, Direct),
        /// The floor.
        Direct(Direct),
        /// The floor's jobs with a busy-polling fence instead of a blocking wait (context: what
        /// the driver's blocking wait costs on a hardware GPU).
        DirectPolled(Direct),
    }

    impl Direct {
        /// On the device and queue of `sup` (taken from a job; the supervisor is idle while the
        /// floor runs, criterion runs one benchmark at a time).
        pub(crate) async fn on(sup: &Supervisor) -> (Self, wgpu::Device, wgpu::AdapterInfo) {
            let (device, queue, info) = sup
                .run(JobSpec::new("probe").expect("valid id"), |ctx| async move {
                    let gpu = ctx.gpu().expect("a GPU slot");
                    Ok::<_, io::Error>((
                        gpu.device().clone(),
                        gpu.queue().clone(),
                        gpu.adapter_info().clone(),
                    ))
                })
                .await
                .expect("probe job");
            let buffers = (0..SLOTS)
                .map(|_| {
                    device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("floor buffer"),
                        size: SCRATCH,
                        usage: wgpu::BufferUsages::STORAGE
                            | wgpu::BufferUsages::COPY_SRC
                            | wgpu::BufferUsages::COPY_DST,
                        mapped_at_creation: false,
                    })
                })
                .collect();
            let direct = Self {
                queue,
                buffers: Arc::new(buffers),
            };
            (direct, device, info)
        }

        /// Finds the `spin` step count for which one fenced job alone takes about `target` on
        /// `device` (the fastest of three, a few rounds of scaling), and keeps it for the run.
        pub(crate) fn calibrate_spin(&self, device: &wgpu::Device, target: Duration) -> u32 {
            let groups = WORK
                .iter()
                .find(|(entry, _)| *entry == "spin")
                .map(|&(_, groups)| groups)
                .expect("a spin work size");
            let mut steps = SPIN_STEPS_DEFAULT;
            for _ in 0..8 {
                let kernel = Kernel::with_steps(device, "spin", groups, steps);
                kernel.run_fenced(&self.queue, &self.buffers[0]);
                let took = (0..3)
                    .map(|_| {
                        let start = Instant::now();
                        kernel.run_fenced(&self.queue, &self.buffers[0]);
                        start.elapsed()
                    })
                    .min()
                    .expect("three runs");
                let scale = target.as_secs_f64() / took.as_secs_f64().max(1e-9);
                println!("spin calibration: {steps} steps took {took:?} (scale {scale:.2})");
                if (0.9..=1.1).contains(&scale) {
                    break;
                }
                steps = ((f64::from(steps) * scale.clamp(0.05, 50.0)) as u32).max(1);
            }
            SPIN_STEPS.store(steps, Relaxed);
            steps
        }
    }

    impl Side {
        /// One batch: `JOBS` jobs at a concurrency of `SLOTS`, all joined.
        pub(crate) async fn batch(&self, kernel: &Arc<Kernel>) -> Duration {
            let start = Instant::now();
            match self {
                Self::Leasehold(sup, job, _) => {
                    let jobs: Vec<_> = (0..JOBS)
                        .map(|_| {
                            let (sup, job, kernel) = (sup.clone(), job.clone(), Arc::clone(kernel));
                            tokio::spawn(leasehold_job(sup, job, kernel))
                        })
                        .collect();
                    for job in jobs {
                        job.await.expect("GPU job task");
                    }
                }
                Self::WithoutGpuSlot(sup, direct) => {
                    let jobs: Vec<_> = (0..JOBS)
                        .map(|_| {
                            let (sup, direct, kernel) =
                                (sup.clone(), direct.clone(), Arc::clone(kernel));
                            tokio::spawn(lifecycle_only_job(sup, direct, kernel))
                        })
                        .collect();
                    for job in jobs {
                        job.await.expect("job task");
                    }
                }
                Self::Direct(direct) | Self::DirectPolled(direct) => {
                    let polled = matches!(self, Self::DirectPolled(_));
                    let streams: Vec<_> = (0..SLOTS as usize)
                        .map(|s| {
                            let (direct, kernel) = (direct.clone(), Arc::clone(kernel));
                            tokio::spawn(async move {
                                for _ in 0..JOBS / SLOTS as usize {
                                    let (direct, kernel) = (direct.clone(), Arc::clone(&kernel));
                                    tokio::task::spawn_blocking(move || {
                                        if polled {
                                            kernel.run_polled(&direct.queue, &direct.buffers[s]);
                                        } else {
                                            kernel.run_fenced(&direct.queue, &direct.buffers[s]);
                                        }
                                    })
                                    .await
                                    .expect("GPU closure");
                                }
                            })
                        })
                        .collect();
                    for stream in streams {
                        stream.await.expect("floor stream");
                    }
                }
            }
            start.elapsed()
        }

        /// The side's backend calls so far (`None`: a floor, whose calls are known by
        /// construction).
        fn calls(&self) -> Option<[u64; CALL_KINDS.len()]> {
            match self {
                Self::Leasehold(_, _, calls) => Some(snapshot(calls)),
                _ => None,
            }
        }
    }

    /// One job through leasehold: a slot, its worker, the dispatch (on the slot's buffer of the
    /// floor's kind, or on its scratch) submitted through the context, then the release fence
    /// (which is this job's fence) and the teardown.
    async fn leasehold_job(sup: Supervisor, job: Job, kernel: Arc<Kernel>) {
        sup.run(
            JobSpec::new("g").expect("valid id"),
            move |ctx| async move {
                let gpu = ctx.gpu().expect("a GPU slot");
                assert!(gpu.device() == &kernel.device, "the job's device changed");
                let commands = match &job {
                    Job::OwnBuffer(direct) => {
                        kernel.encode(&direct.buffers[ctx.slot_id() as usize])
                    }
                    Job::Scratch => kernel.encode(&gpu.scratch().storage),
                };
                gpu.submit([commands]);
                Ok::<_, io::Error>(())
            },
        )
        .await
        .expect("GPU job succeeds");
    }

    /// The floor's job inside a job of a supervisor that owns no GPU: the lifecycle's cost.
    async fn lifecycle_only_job(sup: Supervisor, direct: Direct, kernel: Arc<Kernel>) {
        sup.run(
            JobSpec::new("g").expect("valid id"),
            move |ctx| async move {
                let slot = ctx.slot_id() as usize;
                ctx.spawn_blocking(move || {
                    kernel.run_fenced(&direct.queue, &direct.buffers[slot]);
                })
                .await
                .expect("GPU closure");
                Ok::<_, io::Error>(())
            },
        )
        .await
        .expect("job succeeds");
    }

    pub(crate) fn gpu(c: &mut Criterion) {
        let rt = runtime();
        let root = scratch_dir();
        let mut sups = Vec::new();
        for (name, fence, scratch) in [
            (LEASEHOLD, FencePolicy::Queue, ScratchPolicy::Zeroed),
            (LEASEHOLD_REUSED, FencePolicy::Queue, ScratchPolicy::Reused),
            (
                LEASEHOLD_RECORDED,
                FencePolicy::Recorded,
                ScratchPolicy::Zeroed,
            ),
        ] {
            let Some(started) = rt.block_on(start(&root.path().join(name), fence, scratch)) else {
                return;
            };
            sups.push(started);
        }
        let plain = rt
            .block_on(
                Supervisor::builder()
                    .slots(SLOTS)
                    .work_root(root.path().join(LEASEHOLD_NO_GPU))
                    .start(),
            )
            .expect("a supervisor without GPU slots");
        // The floor's buffers live on the main supervisor's device; the `Recorded` side's jobs
        // get buffers of their own kind on theirs.
        let (direct, direct_device, info) = rt.block_on(Direct::on(&sups[0].0));
        let (recorded_direct, _, _) = rt.block_on(Direct::on(&sups[2].0));
        let adapter = format!(
            "{:?} ({:?}, {:?}, driver {:?} {:?})",
            info.name, info.device_type, info.backend, info.driver, info.driver_info
        );
        println!("gpu benchmarks on {adapter}");
        if let Some(target) = spin_target() {
            let steps = direct.calibrate_spin(&direct_device, target);
            println!("spin: {steps} steps per invocation, for about {target:?} per job");
        }
        *ADAPTER.lock().expect("adapter lock") = Some(adapter);
        let device_of = |sup: &Supervisor| sup.gpu_device(0).expect("device 0 is usable");
        let [
            (main, main_calls),
            (reused, reused_calls),
            (recorded, recorded_calls),
        ] = <[_; 3]>::try_from(sups).unwrap_or_else(|_| unreachable!("three supervisors"));
        let sides: Vec<(&str, Side, wgpu::Device)> = vec![
            (FLOOR, Side::Direct(direct.clone()), direct_device.clone()),
            (
                FLOOR_POLLED,
                Side::DirectPolled(direct.clone()),
                direct_device.clone(),
            ),
            (
                LEASEHOLD_NO_GPU,
                Side::WithoutGpuSlot(plain.clone(), direct.clone()),
                direct_device,
            ),
            (
                LEASEHOLD,
                Side::Leasehold(
                    main.clone(),
                    Job::OwnBuffer(direct),
                    Arc::clone(&main_calls),
                ),
                device_of(&main),
            ),
            (
                LEASEHOLD_SCRATCH,
                Side::Leasehold(main.clone(), Job::Scratch, main_calls),
                device_of(&main),
            ),
            (
                LEASEHOLD_REUSED,
                Side::Leasehold(reused.clone(), Job::Scratch, reused_calls),
                device_of(&reused),
            ),
            (
                LEASEHOLD_RECORDED,
                Side::Leasehold(
                    recorded.clone(),
                    Job::OwnBuffer(recorded_direct),
                    recorded_calls,
                ),
                device_of(&recorded),
            ),
        ];

        let mut group = c.benchmark_group(GROUP);
        group
            .sample_size(SAMPLES)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3))
            .throughput(Throughput::Elements(JOBS as u64));
        for (entry, groups) in WORK {
            let p = format!("jobs={JOBS},slots={SLOTS},work={entry}");
            for (name, side, device) in &sides {
                let kernel = Arc::new(Kernel::new(device, entry, groups));
                let k = key(name, entry);
                group.bench_function(BenchmarkId::new(*name, &p), |b| {
                    timed(b, &rt, &k, |iters| {
                        let (side, kernel) = (side.clone(), Arc::clone(&kernel));
                        async move {
                            let mut total = Duration::ZERO;
                            for _ in 0..iters {
                                total += side.batch(&kernel).await;
                            }
                            total
                        }
                    });
                });
            }
        }
        group.finish();

        // Paired rounds, outside criterion's timing: each round runs one batch of every side,
        // in an order that rotates from round to round, so that the load of a shared machine
        // drifts alike for all of them; the summary takes each round's ratio to the floor and
        // prints their median next to the ratio of criterion's medians. Each batch's backend
        // calls and CPU time are counted too.
        let rounds = if test_mode() { 1 } else { PAIRED_ROUNDS };
        for (entry, groups) in WORK {
            let kernels: Vec<Arc<Kernel>> = sides
                .iter()
                .map(|(_, _, device)| Arc::new(Kernel::new(device, entry, groups)))
                .collect();
            for round in 0..rounds {
                for i in 0..sides.len() {
                    let j = (i + round) % sides.len();
                    let (side, kernel) = (sides[j].1.clone(), Arc::clone(&kernels[j]));
                    let (calls, cpu) = (side.calls(), cpu_time());
                    let took = rt
                        .block_on(rt.spawn(async move { side.batch(&kernel).await }))
                        .expect("paired batch");
                    let k = key(sides[j].0, entry);
                    PAIRED_NS
                        .lock()
                        .expect("paired lock")
                        .entry(k.clone())
                        .or_default()
                        .push(took.as_nanos() as f64);
                    let mut counted = COUNTED.lock().expect("counted lock");
                    let c = counted.entry(k).or_default();
                    c.jobs += JOBS as u64;
                    if let (Some(before), Some(after)) = (calls, sides[j].1.calls()) {
                        let sum = c.calls.get_or_insert([0; CALL_KINDS.len()]);
                        for (s, (b, a)) in sum.iter_mut().zip(before.iter().zip(after)) {
                            *s += a - b;
                        }
                    }
                    if let (Some(before), Some(after)) = (cpu, cpu_time()) {
                        c.cpu += after.saturating_sub(before);
                    }
                }
            }
        }
        // The floor's handles go before the devices do.
        drop(sides);
        rt.block_on(plain.shutdown()).expect("shutdown");
        for (name, sup) in [
            (LEASEHOLD, main),
            (LEASEHOLD_REUSED, reused),
            (LEASEHOLD_RECORDED, recorded),
        ] {
            let report = rt.block_on(sup.shutdown()).expect("shutdown");
            assert_eq!(report.quarantined, 0, "{name}: a GPU slot was quarantined");
        }
    }
}

#[cfg(feature = "gpu")]
use jobs::gpu;

#[cfg(not(feature = "gpu"))]
fn gpu(_c: &mut Criterion) {
    assert_ne!(
        std::env::var(REQUIRE_GPU_ENV).as_deref(),
        Ok("1"),
        "{REQUIRE_GPU_ENV}=1 but the crate was built without the `gpu` feature"
    );
    eprintln!("\n*** SKIPPED gpu benchmarks: the `gpu` feature is off ***\n");
}

// ---------------------------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------------------------

fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

fn summary(_c: &mut Criterion) {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(adapter) = ADAPTER.lock().expect("adapter lock").clone() else {
        return;
    };
    println!();
    println!("## leasehold GPU slots: ratio table");
    println!();
    println!("Adapter: {adapter}.");
    if test_mode() {
        println!("(criterion test mode: every figure below is ONE iteration, not a measurement)");
    } else {
        println!("Medians of the criterion samples taken above (time per batch of {JOBS} jobs).");
    }
    let steps = spin_steps();
    match median(&key(FLOOR, "spin")) {
        Some(floor) => println!(
            "`spin`: {steps} LCG steps per invocation; one floor stream spends {} per job.",
            fmt_ns(floor * f64::from(SLOTS) / JOBS as f64)
        ),
        None => println!("`spin`: {steps} LCG steps per invocation."),
    }
    println!();
    println!(
        "| work | {FLOOR} (floor) | leasehold_run | throughput ratio, criterion medians | throughput ratio, paired rounds | target |"
    );
    println!("|---|---|---|---|---|---|");
    let verdict = |r: f64| {
        if r >= TARGET_THROUGHPUT {
            "met"
        } else {
            "MISSED"
        }
    };
    for (entry, _) in WORK {
        let (Some(floor), Some(lh)) = (median(&key(FLOOR, entry)), median(&key(LEASEHOLD, entry)))
        else {
            println!("| {entry} | not run | not run | - | - | - |");
            continue;
        };
        let ratio = floor / lh;
        let paired = paired_ratio(LEASEHOLD, entry).unwrap_or(f64::NAN);
        println!(
            "| {entry} | {} | {} | {ratio:.3}× ({}) | {paired:.3}× ({}) | ≥ {TARGET_THROUGHPUT}× |",
            fmt_ns(floor),
            fmt_ns(lh),
            verdict(ratio),
            verdict(paired),
        );
    }
    println!();
    println!(
        "| work | context | time per batch | per job vs `leasehold_run` | throughput / floor, criterion | paired |"
    );
    println!("|---|---|---|---|---|---|");
    for (entry, _) in WORK {
        let (Some(floor), Some(lh)) = (median(&key(FLOOR, entry)), median(&key(LEASEHOLD, entry)))
        else {
            continue;
        };
        for (name, what) in [
            (
                LEASEHOLD_SCRATCH,
                "the job on its slot's scratch, cleared when taken",
            ),
            (
                LEASEHOLD_REUSED,
                "the same, `ScratchPolicy::Reused` (taken, not cleared)",
            ),
            (LEASEHOLD_RECORDED, "`FencePolicy::Recorded`"),
            (
                LEASEHOLD_NO_GPU,
                "no GPU slot: the floor's job in a plain `run`",
            ),
            (
                FLOOR_POLLED,
                "the floor with a busy-polling fence (no blocking wait)",
            ),
        ] {
            if let Some(t) = median(&key(name, entry)) {
                let per_job = (t - lh) / JOBS as f64;
                println!(
                    "| {entry} | {what} | {} | {}{} | {:.3}× | {:.3}× |",
                    fmt_ns(t),
                    if per_job >= 0.0 { "+" } else { "−" },
                    fmt_ns(per_job.abs()),
                    floor / t,
                    paired_ratio(name, entry).unwrap_or(f64::NAN),
                );
            }
        }
    }
    println!();
    println!(
        "Where a job's time goes: medians over the paired rounds of (one side − the other) per job."
    );
    println!();
    println!("| work | share | per job |");
    println!("|---|---|---|");
    for (entry, _) in WORK {
        for (what, side, other) in [
            (
                "zeroing the scratch when a job takes it (2 × 1 MiB): `leasehold_run_scratch` − `leasehold_run_scratch_reused`",
                LEASEHOLD_SCRATCH,
                LEASEHOLD_REUSED,
            ),
            (
                "the slot's scratch, cleared, instead of a buffer of the job's own: `leasehold_run_scratch` − `leasehold_run`",
                LEASEHOLD_SCRATCH,
                LEASEHOLD,
            ),
            (
                "the GPU slot (checkout, release fence) instead of the job's own wait: `leasehold_run` − `leasehold_run_without_gpu_slot`",
                LEASEHOLD,
                LEASEHOLD_NO_GPU,
            ),
            (
                "the job lifecycle without a GPU slot: `leasehold_run_without_gpu_slot` − `direct_fenced`",
                LEASEHOLD_NO_GPU,
                FLOOR,
            ),
        ] {
            if let Some(ns) = paired_difference(side, other, entry) {
                println!(
                    "| {entry} | {what} | {}{} |",
                    if ns >= 0.0 { "+" } else { "−" },
                    fmt_ns(ns.abs())
                );
            }
        }
    }
    println!();
    println!(
        "What noise does not move, per job over the paired rounds: calls into the GPU backend \
         (leasehold's counted by a backend hook; the floors' by construction) and the process's \
         CPU time (every thread, the software adapter's included)."
    );
    println!();
    println!(
        "| work | side | submissions: job + clear + fence | blocking waits | non-blocking polls | CPU per job |"
    );
    println!("|---|---|---|---|---|---|");
    let counted = COUNTED.lock().expect("counted lock").clone();
    for (entry, _) in WORK {
        for side in [
            FLOOR,
            FLOOR_POLLED,
            LEASEHOLD_NO_GPU,
            LEASEHOLD,
            LEASEHOLD_SCRATCH,
            LEASEHOLD_REUSED,
            LEASEHOLD_RECORDED,
        ] {
            let Some(c) = counted.get(&key(side, entry)) else {
                continue;
            };
            let jobs = c.jobs.max(1) as f64;
            let (submissions, waits, polls) = match c.calls {
                Some(calls) => {
                    let per = |i: usize| calls[i] as f64 / jobs;
                    (
                        format!(
                            "{:.2} ({:.2} + {:.2} + {:.2})",
                            per(0) + per(1) + per(2),
                            per(0),
                            per(1),
                            per(2)
                        ),
                        format!("{:.2}", per(3)),
                        format!("{:.2}", per(4)),
                    )
                }
                // By construction: one submission each, and the blocking wait (the busy-polling
                // floor polls until done instead).
                None if side == FLOOR_POLLED => {
                    ("1 (1 + 0 + 0)".into(), "0".into(), "until done".into())
                }
                None => ("1 (1 + 0 + 0)".into(), "1".into(), "0".into()),
            };
            println!(
                "| {entry} | {side} | {submissions} | {waits} | {polls} | {} |",
                fmt_ns(c.cpu.as_nanos() as f64 / jobs)
            );
        }
    }
    println!();
}

/// The median over the paired rounds of `(side − other) / JOBS`, in ns per job.
fn paired_difference(side: &str, other: &str, work: &str) -> Option<f64> {
    let paired = PAIRED_NS.lock().expect("paired lock");
    let (side, other) = (
        paired.get(&key(side, work))?,
        paired.get(&key(other, work))?,
    );
    median_of(
        side.iter()
            .zip(other)
            .map(|(s, o)| (s - o) / JOBS as f64)
            .collect(),
    )
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = gpu, summary
}
criterion_main!(benches);
