//! A job's whole lifecycle, one job at a time on 8 slots, each next to the hand-written
//! equivalent of the same shape measured in the same run (see `BENCHMARKS.md`). Every side
//! makes its temp dirs in the same work root, on tmpfs when the machine has one
//! (`floor::scratch_dir`):
//!
//! - `leasehold_run` / `hand_written_ractor_noop` (≤ 2.0×): `run` with a no-op body
//!   that never asks for its temp dir, against a tokio `Semaphore` permit and a fresh ractor
//!   actor per job that runs the body in its `post_start` and stops itself, joined;
//! - `leasehold_run_file` / `hand_written_ractor_file` (≤ 1.5×): a body that writes one file in
//!   its temp dir, against the same with a temp dir made, the file written by the actor's body,
//!   the dir removed;
//! - `leasehold_spawn_job` (≤ 1.5× `leasehold_run`): `spawn_job` of an actor that stops in
//!   `post_start`, its outcome joined, against `run` and against an actor spawned and joined;
//! - `leasehold_submit` (≤ 1.0× `leasehold_run`): the same no-op job through `submit`, its
//!   handle joined (the job is queued by `submit` itself: no task of its own);
//! - `hand_written_task` (context): a permit, a temp dir, the body as a tokio task, joined;
//! - `shape_floor_noop` (`leasehold_run` ≤ 1.3× of it): a lease from the shape floor (one
//!   owner actor by hand, `floor/owner.rs`) and the same per-job ractor worker, joined, the
//!   lease released: leasehold's shape with nothing else.
//!
//! criterion ids are `job_lifecycle/<function>/<shape>`. The last "benchmark", `summary`, prints
//! the ratio rows from the samples criterion took above, then what machine noise does not move:
//! messages into the supervisor's inbox, doorbells and tasks per job, counted by leasehold
//! itself over 2 000 jobs of each shape (`leasehold::Counts`), and, when `strace` and `valgrind`
//! are installed (and not in test mode), system calls and instructions per job for every shape
//! and its floor: this binary re-run under `strace -c -f` and callgrind with
//! `LEASEHOLD_RUN_SHAPE=<shape>:<n>` (run `n` jobs of one shape after 100 to warm up, then exit),
//! once with n = 2 000 and once with n = 0, the difference divided by 2 000.
//! `-- --test` runs each once.

mod floor;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use leasehold::{Counts, Supervisor};
use tokio::sync::Semaphore;

use floor::{key, ratio_row, start_supervisor, table_end, table_start, timed};

const GROUP: &str = "job_lifecycle";
const SAMPLES: usize = 20;
const NOOP: &str = "noop_body";
const FILE: &str = "one_file";
const SLOTS: u32 = 8;
const LEASEHOLD: &str = "leasehold_run";
const LEASEHOLD_FILE: &str = "leasehold_run_file";
const RACTOR_NOOP: &str = "hand_written_ractor_noop";
const RACTOR_FILE: &str = "hand_written_ractor_file";
const TASK: &str = "hand_written_task";
const ACTOR_JOB: &str = "leasehold_spawn_job";
const SUBMIT: &str = "leasehold_submit";
const SHAPE_NOOP: &str = "shape_floor_noop";

/// Targets: wall time (the no-op row also has one in instructions, judged in the callgrind
/// table).
const NOOP_TARGET: f64 = 2.5;
const NOOP_INSTRUCTIONS_TARGET: f64 = 2.0;
const FILE_TARGET: f64 = 1.5;
const ACTOR_JOB_TARGET: f64 = 1.5;
const SUBMIT_TARGET: f64 = 1.0;
const SHAPE_TARGET: f64 = 1.3;

/// Jobs per shape for the counts printed by `summary`.
const COUNTED_JOBS: u64 = 2_000;

/// What every shape's job needs: the supervisor, the floors' semaphore and the work root.
#[derive(Clone)]
struct Jobs {
    sup: Supervisor,
    sem: Arc<Semaphore>,
    owner: floor::Owner,
    root: Arc<PathBuf>,
}

impl Jobs {
    /// One job of a shape: leasehold's, or its hand-written floor's.
    async fn one(&self, shape: &str) {
        match shape {
            LEASEHOLD => floor::noop_run(&self.sup).await,
            LEASEHOLD_FILE => floor::file_run(&self.sup).await,
            ACTOR_JOB => floor::noop_spawn_job(&self.sup).await,
            SUBMIT => floor::noop_submit(&self.sup).await,
            RACTOR_NOOP => floor::hand_written_ractor_noop(&self.sem).await,
            RACTOR_FILE => floor::hand_written_ractor_file(&self.sem, &self.root).await,
            TASK => floor::hand_written_task_job(&self.sem, &self.root).await,
            SHAPE_NOOP => floor::owner_ractor_noop(&self.owner).await,
            other => panic!("unknown shape {other:?}"),
        }
    }
}

/// The runtime, the jobs and the scratch dir, for the whole bench.
struct Setup {
    rt: tokio::runtime::Runtime,
    jobs: Jobs,
    scratch: tempfile::TempDir,
}

fn setup() -> Setup {
    let rt = floor::runtime();
    let scratch = floor::scratch_dir();
    let sup = rt.block_on(start_supervisor(SLOTS, Some(scratch.path())));
    // The supervisor's own work root (canonicalized), where its job temp dirs go: the floors
    // make theirs there too.
    let root = Arc::new(PathBuf::from(sup.work_root()));
    let (owner, _join) = rt.block_on(floor::Owner::start(SLOTS as usize));
    Setup {
        rt,
        jobs: Jobs {
            sup,
            sem: Arc::new(Semaphore::new(SLOTS as usize)),
            owner,
            root,
        },
        scratch,
    }
}

static SETUP: std::sync::OnceLock<Setup> = std::sync::OnceLock::new();

/// `LEASEHOLD_RUN_SHAPE=<shape>:<n>`: runs `n` jobs of one shape (after 100 to warm up) and
/// exits, for `strace` and callgrind (see `counted_externally`).
fn run_one_shape_and_exit(spec: &str) -> ! {
    let (shape, n) = spec.split_once(':').expect("<shape>:<n>");
    let n: u64 = n.parse().expect("a count");
    let s = setup();
    let (shape, jobs) = (shape.to_owned(), s.jobs.clone());
    s.rt.block_on(async move {
        tokio::spawn(async move {
            for n in [100, n] {
                for _ in 0..n {
                    jobs.one(&shape).await;
                }
            }
        })
        .await
        .expect("the shape's loop")
    });
    s.rt.block_on(s.jobs.sup.clone().shutdown())
        .expect("shutdown");
    // Removes the scratch dir (an exit would skip its destructor).
    drop(s);
    std::process::exit(0)
}

fn job_lifecycle(c: &mut Criterion) {
    if let Ok(spec) = std::env::var("LEASEHOLD_RUN_SHAPE") {
        run_one_shape_and_exit(&spec);
    }
    let s = SETUP.get_or_init(setup);
    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(SAMPLES)
        .throughput(Throughput::Elements(1));
    floor::times(
        &mut group,
        Duration::from_millis(500),
        Duration::from_secs(3),
    );

    for (function, shape) in [
        (LEASEHOLD, NOOP),
        (LEASEHOLD_FILE, FILE),
        (ACTOR_JOB, NOOP),
        (SUBMIT, NOOP),
        (RACTOR_NOOP, NOOP),
        (RACTOR_FILE, FILE),
        (TASK, NOOP),
        (SHAPE_NOOP, NOOP),
    ] {
        let k = key(GROUP, function, shape);
        group.bench_function(BenchmarkId::new(function, shape), |b| {
            timed(b, &s.rt, &k, SAMPLES, |iters| {
                let jobs = s.jobs.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        jobs.one(function).await;
                    }
                    start.elapsed()
                }
            });
        });
    }
    group.finish();
}

/// Counts what leasehold did for `n` jobs of a shape (after the timed runs, so nothing else
/// runs on the supervisor).
fn counts_per_job(s: &Setup, shape: &'static str, n: u64) -> Counts {
    let jobs = s.jobs.clone();
    s.rt.block_on(async move {
        tokio::spawn(async move {
            let before = Counts::now();
            for _ in 0..n {
                jobs.one(shape).await;
            }
            Counts::now().since(before)
        })
        .await
        .expect("the counted loop")
    })
}

fn summary(_c: &mut Criterion) {
    if !table_start("a job's lifecycle", "per job") {
        return;
    }
    ratio_row(
        "**`run`, no-op body, no temp dir / a per-job ractor worker** (permit + actor spawned and joined)",
        &key(GROUP, LEASEHOLD, NOOP),
        &key(GROUP, RACTOR_NOOP, NOOP),
        1,
        Some(NOOP_TARGET),
    );
    ratio_row(
        "**`run`, writes one file in its temp dir / the same by hand** (permit + temp dir + actor that writes the file, joined + dir removed)",
        &key(GROUP, LEASEHOLD_FILE, FILE),
        &key(GROUP, RACTOR_FILE, FILE),
        1,
        Some(FILE_TARGET),
    );
    ratio_row(
        "**`spawn_job` (an actor that stops in `post_start`) / `run` no-op**",
        &key(GROUP, ACTOR_JOB, NOOP),
        &key(GROUP, LEASEHOLD, NOOP),
        1,
        Some(ACTOR_JOB_TARGET),
    );
    ratio_row(
        "**`submit` (its handle joined) / `run` no-op**",
        &key(GROUP, SUBMIT, NOOP),
        &key(GROUP, LEASEHOLD, NOOP),
        1,
        Some(SUBMIT_TARGET),
    );
    ratio_row(
        "**`run`, no-op body / the shape floor's** (a lease by message from one owner actor by hand + actor spawned and joined)",
        &key(GROUP, LEASEHOLD, NOOP),
        &key(GROUP, SHAPE_NOOP, NOOP),
        1,
        Some(SHAPE_TARGET),
    );
    ratio_row(
        "`spawn_job` / an actor spawned and joined by hand (permit + actor)",
        &key(GROUP, ACTOR_JOB, NOOP),
        &key(GROUP, RACTOR_NOOP, NOOP),
        1,
        None,
    );
    ratio_row(
        "`run` no-op / a tokio task by hand (permit + temp dir + spawn + join + remove)",
        &key(GROUP, LEASEHOLD, NOOP),
        &key(GROUP, TASK, NOOP),
        1,
        None,
    );
    table_end();

    let Some(s) = SETUP.get() else {
        return;
    };
    let n = if floor::test_mode() { 10 } else { COUNTED_JOBS };
    println!("What noise does not move, counted by leasehold over {n} jobs of each shape:");
    println!();
    println!(
        "| shape | messages into the inbox / job | doorbells / job | tasks leasehold spawned / job | polls / job |"
    );
    println!("|---|---|---|---|---|");
    for (label, shape) in [
        ("`run`, no-op body, no temp dir", LEASEHOLD),
        ("`run`, writes one file in its temp dir", LEASEHOLD_FILE),
        (
            "`spawn_job`, an actor that stops in `post_start`",
            ACTOR_JOB,
        ),
        ("`submit`, no-op body, its handle joined", SUBMIT),
    ] {
        let c = counts_per_job(s, shape, n);
        let per = |x: u64| x as f64 / n as f64;
        println!(
            "| {label} | {:.2} | {:.2} | {:.2} | {:.2} |",
            per(c.messages),
            per(c.rings),
            per(c.tasks),
            per(c.polls)
        );
    }
    println!();
    println!(
        "(the hand-written floors send no message, spawn one actor task per job and are woken twice: the actor, then the caller)"
    );
    println!();
    if !floor::test_mode() {
        counted_externally();
    }
    s.rt.block_on(s.jobs.owner.check_idle());
    s.rt.block_on(s.jobs.sup.clone().shutdown())
        .expect("shutdown");
    // `SETUP` is a static, never dropped: its scratch dir is removed here.
    let _ = std::fs::remove_dir_all(s.scratch.path());
}

/// Jobs per run under `strace` and callgrind.
const EXTERNAL_JOBS: u64 = 2_000;

/// What `f` counts over [`EXTERNAL_JOBS`] jobs of `shape`, minus what it counts over none.
fn per_job(shape: &str, f: &dyn Fn(&str) -> Option<u64>) -> Option<f64> {
    let with = f(&format!("{shape}:{EXTERNAL_JOBS}"))?;
    let without = f(&format!("{shape}:0"))?;
    Some(with.saturating_sub(without) as f64 / EXTERNAL_JOBS as f64)
}

/// This binary re-run with `LEASEHOLD_RUN_SHAPE`, under `program` and `args`; its stderr, or
/// the contents of `out` when given.
fn rerun(
    program: &str,
    args: &[&str],
    spec: &str,
    out: Option<&std::path::Path>,
) -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let output = std::process::Command::new(program)
        .args(args)
        .arg(&exe)
        .arg("--bench")
        .env("LEASEHOLD_RUN_SHAPE", spec)
        .stdout(std::process::Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    match out {
        Some(path) => std::fs::read_to_string(path).ok(),
        None => Some(String::from_utf8_lossy(&output.stderr).into_owned()),
    }
}

/// System calls (`strace -c -f`: the "total" line) of one re-run.
fn syscalls(spec: &str) -> Option<u64> {
    let out = tempfile::NamedTempFile::new().ok()?;
    let path = out.path().to_str()?.to_owned();
    let text = rerun("strace", &["-c", "-f", "-o", &path], spec, Some(out.path()))?;
    let total = text
        .lines()
        .rev()
        .find(|l| l.trim_end().ends_with("total"))?;
    // `% time  seconds  usecs/call  calls  [errors]  total`: the calls column.
    let fields: Vec<&str> = total.split_whitespace().collect();
    fields.get(3)?.parse().ok()
}

/// Instructions (callgrind's "Collected") of one re-run.
fn instructions(spec: &str) -> Option<u64> {
    let text = rerun(
        "valgrind",
        &["--tool=callgrind", "--callgrind-out-file=/dev/null"],
        spec,
        None,
    )?;
    // The last one is this process's: criterion's `gnuplot --version` probe is a fork that
    // prints its own before it execs.
    let line = text.lines().rev().find(|l| l.contains("Collected :"))?;
    line.rsplit(':')
        .next()?
        .trim()
        .replace(',', "")
        .parse()
        .ok()
}

/// System calls and instructions per job of every shape and its floor, when `strace` and
/// `valgrind` are installed.
fn counted_externally() {
    println!(
        "System calls (`strace -c -f`) and instructions (callgrind) per job, this binary re-run with {EXTERNAL_JOBS} jobs and with none:"
    );
    println!();
    println!("| shape | system calls / job | instructions / job |");
    println!("|---|---|---|");
    let missing = || "not measured (tool missing)".to_owned();
    let calls = |x: Option<f64>| x.map_or_else(missing, |v| format!("{v:.2}"));
    let instr = |x: Option<f64>| x.map_or_else(missing, |v| format!("{v:.0}"));
    let (mut noop, mut floor) = (None, None);
    for (label, shape) in [
        ("`run`, no-op body, no temp dir", LEASEHOLD),
        ("floor: permit + actor spawned and joined", RACTOR_NOOP),
        (
            "shape floor: a lease from one owner actor + actor spawned and joined",
            SHAPE_NOOP,
        ),
        ("`run`, writes one file in its temp dir", LEASEHOLD_FILE),
        (
            "floor: permit + temp dir + actor writes the file + dir removed",
            RACTOR_FILE,
        ),
        (
            "`spawn_job`, an actor that stops in `post_start`",
            ACTOR_JOB,
        ),
        ("`submit`, no-op body, its handle joined", SUBMIT),
    ] {
        let instructions = per_job(shape, &instructions);
        match shape {
            LEASEHOLD => noop = instructions,
            RACTOR_NOOP => floor = instructions,
            _ => {}
        }
        println!(
            "| {label} | {} | {} |",
            calls(per_job(shape, &syscalls)),
            instr(instructions)
        );
    }
    println!();
    if let (Some(noop), Some(floor)) = (noop, floor) {
        let ratio = noop / floor;
        let verdict = if ratio <= NOOP_INSTRUCTIONS_TARGET {
            "met"
        } else {
            "MISSED"
        };
        println!(
            "Instructions, `run` no-op / its floor: {ratio:.2}× (target ≤ {NOOP_INSTRUCTIONS_TARGET:.2}×: {verdict})"
        );
        println!();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = job_lifecycle, summary
}
criterion_main!(benches);
