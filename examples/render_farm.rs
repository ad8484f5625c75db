//! A small render farm on GPU slots: every frame is a real wgpu compute job (a fractal zoom
//! described by a scene file in `examples/scenes/`), read back and written as a PNG.
//!
//! K slots share one GPU device (`GpuOptions::slots_per_device(K)`); a slot goes back to the
//! pool only after its job's worker has physically ended, the GPU work it submitted has
//! completed and its temp dir is gone. The run shows every outcome: frames that render, a scene
//! file that does not parse, a formula the GPU's shader validation rejects (caught through a wgpu
//! error scope), a job the caller cancels while its GPU work is in flight (the slot waits for
//! that work), and a frame that is skipped because it is already rendered.
//!
//! ```sh
//! cargo run --release --example render_farm
//! cargo run --release --example render_farm -- --jobs 24 --slots 3 --size 640x480
//! cargo run --release --example render_farm -- --help
//! cargo run --release -p leasehold-console --example render_farm_console -- --console
//! ```
//!
//! Writes `out/render_farm/frames/*.png`, `out/render_farm/trace.json` (open it in
//! <https://ui.perfetto.dev> or `chrome://tracing`) and `out/render_farm/timeline.png`.
//!
//! With `--console` (built by leasehold-console, as above) it also serves leasehold's live web console on
//! 127.0.0.1 (or the address given: `--console 0.0.0.0:8080`, which exposes it to the network),
//! prints its URL (and, with `--console-actions`, turns its actions on and prints their token),
//! records every job's outcome there (a skipped frame as `SKIPPED`, with the note the table
//! below prints and the job's slot), and keeps serving after the run until Enter is pressed.
//!
//! Needs a Vulkan or GL adapter; Mesa's software drivers are enough: lavapipe for Vulkan
//! (Debian package `mesa-vulkan-drivers`) or llvmpipe through EGL for GL (`libegl-mesa0`,
//! `libgl1-mesa-dri`).

#[cfg(any(feature = "gpu", leasehold_console))]
#[path = "render_farm/farm.rs"]
mod farm;
#[cfg(any(feature = "gpu", leasehold_console))]
#[path = "render_farm/render.rs"]
mod render;
#[cfg(any(feature = "gpu", leasehold_console))]
#[path = "render_farm/report.rs"]
mod report;
#[cfg(any(feature = "gpu", leasehold_console))]
#[path = "render_farm/scene.rs"]
mod scene;

#[cfg(not(any(feature = "gpu", leasehold_console)))]
fn main() {
    eprintln!("render_farm needs leasehold's `gpu` feature (on by default)");
}

#[cfg(any(feature = "gpu", leasehold_console))]
#[tokio::main]
async fn main() -> std::process::ExitCode {
    use clap::Parser;
    match app::run(app::Args::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("render_farm: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(any(feature = "gpu", leasehold_console))]
mod app {
    /// The scene files of the repository's `examples/scenes` (leasehold-console builds this demo
    /// from its own directory, `console/`).
    #[cfg(not(leasehold_console))]
    const SCENES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/scenes");
    #[cfg(leasehold_console)]
    const SCENES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/scenes");

    use std::collections::HashMap;
    use std::fmt;
    use std::io::IsTerminal;
    use std::net::SocketAddr;
    use std::path::{Path, PathBuf};
    use std::pin::Pin;
    use std::process::ExitCode;
    use std::sync::Arc;
    use std::task::Poll;
    use std::time::{Duration, Instant};

    use clap::Parser;
    use leasehold::{
        CancellationToken, GpuError, GpuOptions, JobError, JobSpec, StartError, Supervisor,
        WorkerContext,
    };
    use tokio::sync::{oneshot, watch};

    use super::farm::{Farm, Progress, TimingBroker};
    use super::render::{self, Frame, GpuFailure};
    use super::report;
    use super::scene::{self, Scene, SceneError};

    /// Renders fractal frames from scene files on K leased GPU slots.
    #[derive(Parser, Debug)]
    #[command(name = "render_farm", version)]
    pub struct Args {
        /// How many jobs to run; scenes are taken in file-name order and cycled, each cycle
        /// zooming further [default: one job per scene]
        #[arg(long, value_name = "N")]
        jobs: Option<usize>,
        /// GPU slots: leases held at once, all on one device
        #[arg(long, value_name = "K", default_value_t = 2)]
        slots: u32,
        /// Frame size
        #[arg(long, value_name = "WxH", default_value = "320x240", value_parser = parse_size)]
        size: Size,
        /// Output directory (frames/, trace.json, timeline.png)
        #[arg(long, value_name = "DIR", default_value = "out/render_farm")]
        out: PathBuf,
        /// Cancel the victim job this many milliseconds after its body starts, instead of as
        /// soon as it has submitted its GPU work
        #[arg(long, value_name = "MS")]
        cancel_after: Option<u64>,
        /// Picks which job is cancelled, among the jobs that render a built-in formula
        /// [default: the heaviest of them, so that its GPU work in flight is easy to see]
        #[arg(long)]
        seed: Option<u64>,
        /// Where the scene files are
        #[arg(long, value_name = "DIR", default_value = SCENES)]
        scenes: PathBuf,
        /// Serve the live web console (in the `render_farm_console` build) on 127.0.0.1, or on ADDR
        /// (another address exposes it to whoever can reach it); it keeps serving after the
        /// run until Enter is pressed
        #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
        console: Option<SocketAddr>,
        /// With --console: turn the console's actions (cancel, reclaim, resize) on, and print
        /// the token they need (printed only when asked for)
        #[arg(long, requires = "console")]
        console_actions: bool,
    }

    #[derive(Debug, Clone, Copy)]
    struct Size {
        width: u32,
        height: u32,
    }

    fn parse_size(text: &str) -> Result<Size, String> {
        let (w, h) = text
            .split_once(['x', 'X'])
            .ok_or_else(|| format!("expected WxH, e.g. 320x240, got `{text}`"))?;
        let dim = |s: &str| {
            s.trim()
                .parse::<u32>()
                .ok()
                .filter(|v| (8..=4096).contains(v))
                .ok_or_else(|| format!("`{s}` is not a size in 8..=4096"))
        };
        Ok(Size {
            width: dim(w)?,
            height: dim(h)?,
        })
    }

    /// Why a job's body failed.
    #[derive(Debug)]
    enum FarmError {
        Scene(SceneError),
        /// The shader or pipeline was rejected (captured through a validation error scope).
        Validation(GpuFailure),
        Gpu(GpuFailure),
        Io(String),
        Cancelled,
    }

    impl fmt::Display for FarmError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                FarmError::Scene(e) => write!(f, "scene file: {e}"),
                FarmError::Validation(e) => write!(f, "GPU validation (error scope): {e}"),
                FarmError::Gpu(e) => write!(f, "GPU: {e}"),
                FarmError::Io(e) => write!(f, "i/o: {e}"),
                FarmError::Cancelled => f.write_str("cancelled before the frame was read back"),
            }
        }
    }

    impl std::error::Error for FarmError {}

    fn io_err(e: impl fmt::Display) -> FarmError {
        FarmError::Io(e.to_string())
    }

    /// What a successful body returns.
    #[derive(Debug)]
    enum Done {
        Rendered {
            name: String,
            frame: String,
            bytes: u64,
        },
        Skipped {
            frame: String,
        },
    }

    /// Everything a job's body needs.
    struct JobInput {
        index: usize,
        scene_path: PathBuf,
        stem: String,
        cycle: u32,
        size: Size,
        frames: PathBuf,
        /// The victim tells the caller when its body started and when its GPU work is submitted.
        started: Option<oneshot::Sender<()>>,
        submitted: Option<oneshot::Sender<()>>,
    }

    /// The frame file a scene renders in a cycle.
    fn frame_name(scene: &Scene, stem: &str, cycle: u32) -> String {
        let base = scene.output.as_deref().unwrap_or(stem);
        if cycle == 0 {
            format!("{base}.png")
        } else {
            format!("{base}-c{cycle}.png")
        }
    }

    /// The job body: parse the scene, skip a frame that exists, else render it on the lease's
    /// GPU.
    async fn body(
        ctx: WorkerContext,
        mut job: JobInput,
        farm: Arc<Farm>,
    ) -> Result<Done, FarmError> {
        farm.body_started(job.index, ctx.slot_id(), ctx.lease_id());
        if let Some(tx) = job.started.take() {
            let _ = tx.send(());
        }
        let index = job.index;
        let result = render_frame(&ctx, job, &farm).await;
        if let Some(gpu) = ctx.gpu() {
            // Fires once the queue has completed everything submitted so far: the point the
            // release's GPU fence waits for.
            let farm = Arc::clone(&farm);
            gpu.queue()
                .on_submitted_work_done(move || farm.queue_done(index));
        }
        farm.body_ended(index);
        result
    }

    async fn render_frame(
        ctx: &WorkerContext,
        mut job: JobInput,
        farm: &Arc<Farm>,
    ) -> Result<Done, FarmError> {
        let path = job.scene_path.clone();
        let text = ctx
            .spawn_blocking(move || std::fs::read_to_string(path))
            .await
            .map_err(io_err)?
            .map_err(io_err)?;
        let scene = scene::parse(&text).map_err(FarmError::Scene)?;
        let frame_file = frame_name(&scene, &job.stem, job.cycle);
        let dest = job.frames.join(&frame_file);
        if dest.exists() {
            return Ok(Done::Skipped { frame: frame_file });
        }
        let gpu = ctx
            .gpu()
            .cloned()
            .ok_or_else(|| FarmError::Gpu(GpuFailure("the supervisor has no GPU".into())))?;
        farm.set_adapter(gpu.adapter_info());
        let frame = Frame {
            width: job.size.width,
            height: job.size.height,
            zoom: scene.zoom_step.powi(job.cycle as i32),
            scene,
        };
        farm.phase(job.index, "rendering: compiling the shader");
        let submission = {
            let (gpu, frame, farm, cancel) = (
                gpu.clone(),
                frame.clone(),
                Arc::clone(farm),
                ctx.cancellation_token(),
            );
            let index = job.index;
            ctx.spawn_blocking(move || {
                render::build_and_submit(&gpu, &frame, &cancel, move || farm.gpu_done(index))
            })
            .await
            .map_err(io_err)?
            .map_err(FarmError::Validation)?
        };
        let Some(submission) = submission else {
            return Err(FarmError::Cancelled);
        };
        farm.submitted(job.index);
        if let Some(tx) = job.submitted.take() {
            let _ = tx.send(());
        }
        // The wait is tracked work: if the caller cancels, the body returns at once, but the
        // worker (and so the slot) stays until the wait, and the GPU work, has ended; the
        // release's GPU fence then proves the queue done before the slot moves on.
        let waiting = {
            let gpu = gpu.clone();
            ctx.spawn_blocking(move || render::wait_for(&gpu, submission))
        };
        tokio::select! {
            biased;
            () = ctx.cancelled() => return Err(FarmError::Cancelled),
            waited = waiting => waited.map_err(io_err)?.map_err(FarmError::Gpu)?,
        }
        if ctx.is_cancelled() {
            // The GPU finished first, but nothing has been published yet: honour the cancel.
            return Err(FarmError::Cancelled);
        }
        farm.phase(job.index, "rendering: reading back, writing the PNG");
        let name = frame.scene.name.clone();
        let tmp = ctx.path("frame.png").map_err(io_err)?;
        let bytes = ctx
            .spawn_blocking(move || render::read_back_and_write(&gpu, &frame, &tmp, &dest))
            .await
            .map_err(io_err)?
            .map_err(FarmError::Gpu)?;
        Ok(Done::Rendered {
            name,
            frame: frame_file,
            bytes,
        })
    }

    /// Awaits every future, polling them in order (the first poll of each `run` sends its
    /// slot request, so requests reach the supervisor's FIFO queue in job order).
    async fn join_in_order(mut futures: Vec<Pin<Box<dyn Future<Output = ()> + Send>>>) {
        let mut done = vec![false; futures.len()];
        std::future::poll_fn(|cx| {
            for (future, done) in futures.iter_mut().zip(done.iter_mut()) {
                if !*done && future.as_mut().poll(cx).is_ready() {
                    *done = true;
                }
            }
            if done.iter().all(|d| *d) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }

    /// SplitMix64: a tiny deterministic generator for the seed.
    fn splitmix64(seed: u64) -> u64 {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// One planned job, as the caller sees it before running it.
    struct Plan {
        id: String,
        stem: String,
        scene_path: PathBuf,
        cycle: u32,
        /// The caller's own look at the scene (the body parses it again, for real).
        preview: Option<Scene>,
        /// An earlier job of this run renders the same frame: start after it.
        after: Option<usize>,
    }

    fn plan_jobs(scenes_dir: &Path, jobs: Option<usize>) -> Result<Vec<Plan>, String> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(scenes_dir)
            .map_err(|e| format!("cannot read {}: {e}", scenes_dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "scene"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(format!("no *.scene files in {}", scenes_dir.display()));
        }
        let n = jobs.unwrap_or(files.len());
        let mut plans: Vec<Plan> = Vec::with_capacity(n);
        let mut producer: HashMap<String, usize> = HashMap::new();
        for i in 0..n {
            let path = &files[i % files.len()];
            let cycle = (i / files.len()) as u32;
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let id = if cycle == 0 {
                stem.clone()
            } else {
                format!("{stem}-c{cycle}")
            };
            let preview = std::fs::read_to_string(path)
                .ok()
                .and_then(|t| scene::parse(&t).ok());
            let after = preview.as_ref().and_then(|s| {
                let name = frame_name(s, &stem, cycle);
                match producer.get(&name) {
                    Some(&first) => Some(first),
                    None => {
                        producer.insert(name, i);
                        None
                    }
                }
            });
            plans.push(Plan {
                id,
                stem,
                scene_path: path.clone(),
                cycle,
                preview,
                after,
            });
        }
        Ok(plans)
    }

    /// Removes the frames of an earlier run, so that only this run's own frames are skipped.
    fn fresh_frames_dir(frames: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(frames)?;
        for entry in std::fs::read_dir(frames)? {
            let path = entry?.path();
            if path.extension().is_some_and(|x| x == "png") {
                std::fs::remove_file(path)?;
            }
        }
        Ok(())
    }

    pub async fn run(args: Args) -> Result<ExitCode, Box<dyn std::error::Error>> {
        if args.slots == 0 {
            return Err("--slots must be at least 1".into());
        }
        #[cfg(not(leasehold_console))]
        if args.console.is_some() {
            return Err(
                "--console needs the web console, which leasehold-console builds in: cargo run \
                        --release -p leasehold-console --example render_farm_console -- --console"
                    .into(),
            );
        }
        let plans = plan_jobs(&args.scenes, args.jobs)?;
        let frames = args.out.join("frames");
        fresh_frames_dir(&frames)?;
        let work_root = args.out.join(".work");

        // The victim: among jobs that render a built-in formula (so it surely reaches the GPU).
        // Not a job whose frame a later job waits for (that one is meant to be skipped).
        let awaited: Vec<usize> = plans.iter().filter_map(|p| p.after).collect();
        let candidates: Vec<usize> = plans
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                p.after.is_none()
                    && !awaited.contains(i)
                    && p.preview.as_ref().is_some_and(|s| s.formula.is_none())
            })
            .map(|(i, _)| i)
            .collect();
        let cost = |i: &usize| {
            plans[*i].preview.as_ref().map_or(0, |s| {
                u64::from(s.iterations) * u64::from(s.supersample * s.supersample)
            })
        };
        let victim = match args.seed {
            _ if candidates.is_empty() => None,
            Some(seed) => Some(candidates[(splitmix64(seed) % candidates.len() as u64) as usize]),
            None => candidates
                .iter()
                .copied()
                .max_by_key(|i| (cost(i), usize::MAX - i)),
        };
        let chosen_by = args
            .seed
            .map_or_else(|| "the heaviest frame".to_string(), |s| format!("seed {s}"));

        let live = std::io::stdout().is_terminal();
        let progress = Progress::new(args.slots, plans.len() as u64, live);
        let farm = Farm::new(
            plans
                .iter()
                .map(|p| {
                    let file = p.scene_path.file_name().unwrap_or_default();
                    (p.id.clone(), file.to_string_lossy().into_owned())
                })
                .collect(),
            progress,
        );

        let frame_bytes = u64::from(args.size.width) * u64::from(args.size.height) * 4;
        let gpu = GpuOptions::new()
            .slots_per_device(args.slots)
            .scratch_bytes(frame_bytes.max(1 << 20).next_multiple_of(256));
        let started = Instant::now();
        let sup = match Supervisor::builder()
            .broker(TimingBroker::new(args.slots, Arc::clone(&farm)))
            .gpu(gpu)
            .work_root(&work_root)
            .start()
            .await
        {
            Ok(sup) => sup,
            Err(StartError::Gpu(e)) => {
                farm.progress().finish();
                let advice = match e {
                    // An adapter was there, its device would not open: a driver or backend
                    // problem, not a missing driver (e.g. GL on NVIDIA's EGL).
                    GpuError::CreateFailed(_) => {
                        "another backend may work: try WGPU_BACKEND=vulkan (or gl)"
                    }
                    _ => {
                        "install a Vulkan or GL driver, e.g. Mesa's software ones: apt-get \
                         install mesa-vulkan-drivers libvulkan1 (Vulkan) or libegl1 libegl-mesa0 \
                         libgl1-mesa-dri (GL)"
                    }
                };
                eprintln!("\n*** SKIPPED: no usable GPU adapter ({e}); {advice} ***\n");
                return Ok(ExitCode::SUCCESS);
            }
            Err(e) => {
                farm.progress().finish();
                return Err(e.into());
            }
        };
        let progress = farm.progress();
        // The live web console: started before the jobs so that the page shows the whole run.
        #[cfg(leasehold_console)]
        let console = match args.console {
            Some(addr) => Some(web::start(&sup, addr, args.console_actions, progress).await?),
            None => None,
        };
        #[cfg(leasehold_console)]
        let outcomes = console.as_ref().map(|c| c.outcomes());
        progress.println(format!(
            "render_farm: {} jobs from {}, {} GPU slot(s) on one device, {}x{} frames \
             (GPU opened in {} ms)",
            plans.len(),
            args.scenes.display(),
            args.slots,
            args.size.width,
            args.size.height,
            started.elapsed().as_millis()
        ));
        progress.println(match (victim, args.cancel_after) {
            (Some(v), None) => format!(
                "cancel: {} ({chosen_by}), once it has submitted its GPU work",
                plans[v].id
            ),
            (Some(v), Some(ms)) => format!(
                "cancel: {} ({chosen_by}), {ms} ms after its body starts",
                plans[v].id
            ),
            (None, _) => "cancel: no job renders a built-in formula, nothing to cancel".into(),
        });

        let done: Vec<(watch::Sender<bool>, watch::Receiver<bool>)> =
            plans.iter().map(|_| watch::channel(false)).collect();
        let mut jobs: Vec<Pin<Box<dyn Future<Output = ()> + Send>>> = Vec::new();
        for (index, plan) in plans.iter().enumerate() {
            let token = CancellationToken::new();
            let (mut started_tx, mut submitted_tx) = (None, None);
            if victim == Some(index) {
                let (s_tx, s_rx) = oneshot::channel::<()>();
                let (g_tx, g_rx) = oneshot::channel::<()>();
                started_tx = Some(s_tx);
                submitted_tx = Some(g_tx);
                let (token, farm, id) = (token.clone(), Arc::clone(&farm), plan.id.clone());
                let mut finished = done[index].1.clone();
                let after = args.cancel_after;
                tokio::spawn(async move {
                    // Gates only: the cancel follows the body's own signal.
                    let why = match after {
                        None => g_rx
                            .await
                            .ok()
                            .map(|()| "it has submitted its GPU work".into()),
                        Some(ms) => match s_rx.await {
                            Ok(()) => {
                                tokio::select! {
                                    () = tokio::time::sleep(Duration::from_millis(ms)) =>
                                        Some(format!("{ms} ms after its body started")),
                                    _ = finished.wait_for(|d| *d) => None,
                                }
                            }
                            Err(_) => None,
                        },
                    };
                    if let Some(why) = why {
                        farm.log(&format!("cancelling {id}: {why}"));
                        farm.cancel_requested(index);
                        token.cancel();
                    }
                });
            }
            let input = JobInput {
                index,
                scene_path: plan.scene_path.clone(),
                stem: plan.stem.clone(),
                cycle: plan.cycle,
                size: args.size,
                frames: frames.clone(),
                started: started_tx,
                submitted: submitted_tx,
            };
            let spec = JobSpec::new(plan.id.clone())?.with_cancel(token);
            let gate = plan.after.map(|a| done[a].1.clone());
            let finished = done[index].0.clone();
            let (sup, farm) = (sup.clone(), Arc::clone(&farm));
            #[cfg(leasehold_console)]
            let (outcomes, id) = (outcomes.clone(), plan.id.clone());
            jobs.push(Box::pin(async move {
                if let Some(mut gate) = gate {
                    // Its frame is rendered by an earlier job: wait for that job to end.
                    let _ = gate.wait_for(|d| *d).await;
                }
                farm.called(index);
                let job_farm = Arc::clone(&farm);
                let result = sup.run(spec, move |ctx| body(ctx, input, job_farm)).await;
                let (outcome, note) = describe(&result, &farm, index);
                #[cfg(leasehold_console)]
                if let Some(outcomes) = &outcomes {
                    web::record(
                        outcomes,
                        &id,
                        &result,
                        (&outcome, &note),
                        &farm.records()[index],
                    );
                }
                farm.returned(index, &outcome, note);
                let _ = finished.send(true);
            }));
        }
        // The live slot lines, from the supervisor's lease table: a read of a concurrent map,
        // no message to the supervisor, as a game's overlay would do every frame.
        let overlay = {
            let (sup, farm) = (sup.clone(), Arc::clone(&farm));
            tokio::spawn(async move {
                let mut frame = tokio::time::interval(Duration::from_millis(100));
                loop {
                    frame.tick().await;
                    farm.progress().show_leases(&sup.leases());
                }
            })
        };
        // Polled in job order from this task, so the jobs queue for slots in that order.
        join_in_order(jobs).await;
        overlay.abort();
        let elapsed = started.elapsed();
        farm.progress().finish();

        let records = farm.records();
        println!();
        print!("{}", report::table(&records));
        let stats = sup.stats();
        println!();
        println!("final stats: {stats:?}");
        let clean = stats.active == 0
            && stats.quarantined == 0
            && stats.waiting == 0
            && stats.release_failed_total == 0
            && stats.acquired_total == stats.released_total;
        println!(
            "every slot came back: {} (active {}, quarantined {}, acquired {} == released {})",
            if clean { "yes" } else { "NO" },
            stats.active,
            stats.quarantined,
            stats.acquired_total,
            stats.released_total
        );
        let count = |code: &str| records.iter().filter(|r| r.outcome == code).count();
        println!(
            "outcomes: {} OK, {} SKIPPED, {} LEASE_BODY_FAILED, {} LEASE_BODY_CANCELLED, {} other",
            count("OK"),
            count("SKIPPED"),
            count("LEASE_BODY_FAILED"),
            count("LEASE_BODY_CANCELLED"),
            records.len()
                - count("OK")
                - count("SKIPPED")
                - count("LEASE_BODY_FAILED")
                - count("LEASE_BODY_CANCELLED"),
        );
        let adapter = farm.adapter().unwrap_or_else(|| "none used".into());
        println!("adapter: {adapter}");

        let t0 = records
            .iter()
            .filter_map(|r| r.called)
            .min()
            .unwrap_or(farm.t0);
        let trace_path = args.out.join("trace.json");
        std::fs::write(
            &trace_path,
            serde_json::to_vec_pretty(&report::trace(&records, t0, args.slots))?,
        )?;
        let timeline_path = args.out.join("timeline.png");
        report::register_font()?;
        let title = format!(
            "leasehold render_farm: {} jobs on {} GPU slot(s), {}x{}, {:.2} s; adapter {}",
            records.len(),
            args.slots,
            args.size.width,
            args.size.height,
            elapsed.as_secs_f64(),
            adapter.split(" (").next().unwrap_or(&adapter),
        );
        report::timeline(&timeline_path, &records, t0, args.slots, &title)?;

        #[cfg(leasehold_console)]
        if let Some(console) = console {
            web::serve_until_enter(console).await?;
        }
        let report = sup.shutdown().await?;
        // The work root is ours (not the supervisor's default), empty once every job is done.
        let _ = std::fs::remove_dir(&work_root);
        println!(
            "shutdown: {} quarantined, {} cancelled at shutdown",
            report.quarantined, report.cancelled_jobs
        );
        println!(
            "wrote {} frame(s) to {}, {} and {} in {:.2} s",
            count("OK"),
            frames.display(),
            trace_path.display(),
            timeline_path.display(),
            elapsed.as_secs_f64()
        );
        Ok(if clean && report.quarantined == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }

    /// The live web console (`--console`, in the build of leasehold-console).
    #[cfg(leasehold_console)]
    mod web {
        use std::net::SocketAddr;

        use leasehold::{JobError, Supervisor};
        use leasehold_console::{ActionsToken, Console, ConsoleHandle, JobNote, Outcomes};

        use crate::farm::{JobRecord, Progress};

        /// Starts the console on `addr`, read-only unless `actions`: then with a fresh actions
        /// token, which it prints.
        pub async fn start(
            sup: &Supervisor,
            addr: SocketAddr,
            actions: bool,
            progress: &Progress,
        ) -> Result<ConsoleHandle, Box<dyn std::error::Error>> {
            let token = actions.then(ActionsToken::random).transpose()?;
            let mut builder = Console::builder(sup.clone()).bind(addr);
            if let Some(token) = &token {
                builder = builder.actions(token.clone());
            }
            let console = builder.start().await?;
            progress.println(match &token {
                Some(token) => format!(
                    "console: {} (actions token: {})",
                    console.url(),
                    token.expose()
                ),
                None => format!(
                    "console: {} (read-only; --console-actions turns the actions on and prints \
                     their token)",
                    console.url()
                ),
            });
            Ok(console)
        }

        /// Hands a job's result to the console with the demo's own word on it: its label when
        /// the code does not say it (`SKIPPED`: the frame was rendered already, the body
        /// returned `Ok` early), its note, and the slot and lease its body saw (a frame skipped
        /// within one sample is never seen holding its slot by the console).
        pub fn record<T, E: std::fmt::Display>(
            outcomes: &Outcomes,
            id: &str,
            result: &Result<T, JobError<E>>,
            (outcome, note): (&str, &str),
            record: &JobRecord,
        ) {
            let code = match result {
                Ok(_) => "OK",
                Err(e) => e.code(),
            };
            let mut said = JobNote::new().note(note);
            if outcome != code {
                // A label of the demo's own making: always a valid one.
                said = said
                    .label(outcome)
                    .unwrap_or_else(|_| JobNote::new().note(note));
            }
            if let Some(slot) = record.slot {
                said = said.slot(slot);
            }
            if let Some(lease) = record.lease {
                said = said.lease(lease);
            }
            outcomes.record_with(id, result, said);
        }

        /// Keeps the console serving until Enter (or the end of standard input), then stops it.
        pub async fn serve_until_enter(
            console: ConsoleHandle,
        ) -> Result<(), Box<dyn std::error::Error>> {
            println!(
                "console: still serving at {}; press Enter to stop",
                console.url()
            );
            tokio::task::spawn_blocking(|| {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line)
            })
            .await??;
            console.shutdown().await?;
            Ok(())
        }
    }

    /// The outcome column (`OK`, `SKIPPED` or the error code) and a note.
    fn describe(
        result: &Result<Done, JobError<FarmError>>,
        farm: &Farm,
        index: usize,
    ) -> (String, String) {
        let record = &farm.records()[index];
        let gpu_ms = record.gpu_wait_ms().unwrap_or(0.0);
        match result {
            Ok(Done::Rendered { name, frame, bytes }) => {
                let mut note = format!("{name}: frames/{frame} ({} KiB read back)", bytes / 1024);
                match (record.cancel_requested, record.body_end) {
                    (Some(c), Some(end)) if c <= end => {
                        note.push_str("; cancelled while the PNG was written: kept");
                    }
                    (Some(_), _) => note.push_str("; the cancel came after the body had ended"),
                    _ => {}
                }
                ("OK".to_string(), note)
            }
            Ok(Done::Skipped { frame }) => (
                "SKIPPED".to_string(),
                format!("frames/{frame} already rendered: returned early"),
            ),
            Err(e) => {
                let mut note = match e.body_error().and_then(|b| b.error()) {
                    Some(FarmError::Cancelled) => {
                        let note = if record.submitted.is_some() {
                            format!(
                                "cancelled, GPU work in flight: slot held {gpu_ms:.1} ms for it"
                            )
                        } else {
                            "cancelled before it submitted GPU work".to_string()
                        };
                        return (e.code().to_string(), note);
                    }
                    Some(other) => other.to_string(),
                    None => e.to_string(),
                };
                if let Some(c) = e.cleanup_error() {
                    note.push_str(&format!("; cleanup: {c}"));
                }
                (e.code().to_string(), note)
            }
        }
    }
}
