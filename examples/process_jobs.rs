//! Jobs that run real child processes (Linux).
//!
//! Six jobs share two slots. Each one that gets past the path check runs an `sh` script that
//! writes frames into the job's temp dir, runs `sort | uniq` on them and starts a helper
//! `sleep` in the background, in the same process group. What the example shows:
//!
//! * `sort-1`, `sort-3`: the script exits and leaves its helper `sleep` running. The slot waits
//!   for the helper too, because it is still a member of the job's process group.
//! * `cancel-2`, `cancel-6`: cancelled through `JobSpec::with_cancel` once the child has
//!   printed its pids. The group gets `SIGTERM`.
//! * `stubborn-4`: ignores `SIGTERM` (`trap '' TERM`), so it is `SIGKILL`ed once the 300 ms
//!   process grace has passed.
//! * `escape-5`: asks for `../escape.txt`. The path is refused with `JOB_PATH_REFUSED` and
//!   nothing runs.
//!
//! Nothing here uses a sleep to win a race. A job is cancelled only after its child's stdout
//! has given its pids. The checks made after a job ends need no waiting, because `run` returns
//! only after the group has been proven empty, the temp dir removed and the slot released.
//!
//! ```sh
//! cargo run --example process_jobs
//! ```
#![cfg_attr(not(target_os = "linux"), allow(unused))]

use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use leasehold::{
    CancellationToken, JobError, JobProcess, JobSpec, ProcessError, ProcessSpec, Stats, Supervisor,
    WorkerContext,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;

const SLOTS: u32 = 2;
const PROCESS_GRACE: Duration = Duration::from_millis(300);

/// Writes 12 frames (4 distinct ones), reduces them to `out.txt`, starts a helper that
/// outlives the script, and prints `leader helper` pids.
const SORT_SCRIPT: &str = r#"
i=0
while [ $i -lt 12 ]; do echo "frame-$((i % 4))" >> frames.txt; i=$((i + 1)); done
sort frames.txt | uniq > out.txt
sleep 0.3 &
echo $$ $!
"#;

/// Writes 8 frames, prints its pids, and waits for a helper that would run for 30 s. The job is
/// cancelled during that wait, so `out.txt` is never written.
const CANCEL_SCRIPT: &str = r#"
i=0
while [ $i -lt 8 ]; do echo "frame-$((i % 3))" >> frames.txt; i=$((i + 1)); done
sleep 30 &
echo $$ $!
wait
sort frames.txt | uniq > out.txt
"#;

/// Like `CANCEL_SCRIPT`, but `SIGTERM` is ignored. An ignored signal stays ignored across exec,
/// so the helper `sleep` ignores it too.
const STUBBORN_SCRIPT: &str = r#"
trap '' TERM
i=0
while [ $i -lt 8 ]; do echo "frame-$((i % 3))" >> frames.txt; i=$((i + 1)); done
sleep 30 &
echo $$ $!
wait
sort frames.txt | uniq > out.txt
"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Runs to the end. Its helper outlives the script.
    Sort,
    /// Cancelled mid-run and stopped by `SIGTERM`.
    Cancel,
    /// Cancelled mid-run. Ignores `SIGTERM`, so it is stopped by `SIGKILL` after the grace.
    Stubborn,
    /// Names `../escape.txt`: refused before anything is spawned.
    Escape,
}

impl Kind {
    /// The outcome the run must end with: the run's code and the detail that goes with it.
    fn expected(self) -> (&'static str, &'static str) {
        match self {
            Kind::Sort => ("OK", "4 unique frames"),
            Kind::Cancel => ("LEASE_BODY_CANCELLED", "leader killed by SIGTERM"),
            Kind::Stubborn => ("LEASE_BODY_CANCELLED", "leader killed by SIGKILL"),
            Kind::Escape => ("LEASE_BODY_FAILED", "JOB_PATH_REFUSED"),
        }
    }

    fn cancelled(self) -> bool {
        matches!(self, Kind::Cancel | Kind::Stubborn)
    }
}

const PLAN: [(&str, Kind); 6] = [
    ("sort-1", Kind::Sort),
    ("cancel-2", Kind::Cancel),
    ("sort-3", Kind::Sort),
    ("stubborn-4", Kind::Stubborn),
    ("escape-5", Kind::Escape),
    ("cancel-6", Kind::Cancel),
];

/// What the body saw. It lives outside the body so that the driver can read it after `run`.
#[derive(Debug, Default)]
struct Seen {
    slot: Option<u32>,
    temp_dir: Option<PathBuf>,
    pids: Vec<i32>,
}

/// The value of a job that ran to the end.
#[derive(Debug)]
struct Done {
    unique_frames: usize,
}

/// Why a job's body failed.
#[derive(Debug)]
enum Failure {
    /// `spawn_process` refused the spec or could not start it.
    Process(ProcessError),
    /// The body's own I/O: reading the child's stdout or the temp dir.
    Io(io::Error),
    /// The group leader did not exit successfully.
    Stopped(ExitStatus),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Process(e) => write!(f, "{}", e.code()),
            Failure::Io(e) => write!(f, "I/O error: {e}"),
            Failure::Stopped(status) => match status.signal() {
                Some(sig) => write!(f, "leader killed by {}", signal_name(sig)),
                None => write!(f, "leader exited with {status}"),
            },
        }
    }
}

impl std::error::Error for Failure {}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Io(e)
    }
}

impl From<ProcessError> for Failure {
    fn from(e: ProcessError) -> Self {
        Failure::Process(e)
    }
}

/// One row of the final summary.
#[derive(Debug)]
struct Report {
    id: &'static str,
    slot: Option<u32>,
    outcome: String,
    detail: String,
    pids: Vec<i32>,
    /// Every recorded pid was gone from `/proc` when `run` returned.
    proven_empty: bool,
    /// The temp dir was gone when `run` returned.
    dir_gone: bool,
    /// The outcome and detail are the ones `Kind::expected` names.
    as_expected: bool,
}

static START: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the example started.
fn ms() -> u128 {
    START.get_or_init(Instant::now).elapsed().as_millis()
}

fn log(job: &str, event: impl fmt::Display) {
    println!("{:>6} ms  {job:<10}  {event}", ms());
}

fn signal_name(sig: i32) -> String {
    match sig {
        9 => "SIGKILL".to_owned(),
        15 => "SIGTERM".to_owned(),
        n => format!("signal {n}"),
    }
}

fn exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn stats_line(s: &Stats) -> String {
    format!(
        "active={} waiting={} quarantined={} acquired={} released={}",
        s.active, s.waiting, s.quarantined, s.acquired_total, s.released_total
    )
}

fn pid_list(pids: &[i32]) -> String {
    if pids.is_empty() {
        "-".to_owned()
    } else {
        pids.iter()
            .map(i32::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(not(target_os = "linux"))]
fn main() {
    println!("process_jobs: this example runs on Linux only (it reads /proc)");
}

#[cfg(target_os = "linux")]
#[tokio::main]
async fn main() -> ExitCode {
    START.get_or_init(Instant::now);
    let sup = match Supervisor::builder()
        .slots(SLOTS)
        .process_grace(PROCESS_GRACE)
        .start()
        .await
    {
        Ok(sup) => sup,
        Err(e) => {
            eprintln!("could not start the supervisor: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "{} jobs on {SLOTS} slots, process grace {} ms",
        PLAN.len(),
        PROCESS_GRACE.as_millis()
    );
    println!("work root: {}", sup.work_root().display());
    println!();
    println!("{:>9}  {:<10}  event", "time", "job");
    println!(
        "{:>9}  {:<10}  {}",
        "-".repeat(9),
        "-".repeat(10),
        "-".repeat(60)
    );

    // The futures are polled in order on their first poll, so the jobs join the slot queue in
    // PLAN order. The bodies run in worker actors, not here.
    let reports =
        futures_util::future::join_all(PLAN.iter().map(|&(id, kind)| drive(sup.clone(), id, kind)))
            .await;

    let mut failures = Vec::new();
    println!();
    println!(
        "{:<10}  {:>4}  {:<20}  {:<24}  {:<13}  {:<12}  temp dir gone",
        "job", "slot", "outcome", "detail", "pids", "proven empty"
    );
    for r in &reports {
        let slot = r.slot.map_or_else(|| "-".to_owned(), |s| s.to_string());
        let empty = match (r.proven_empty, r.pids.is_empty()) {
            (true, true) => "yes (none)",
            (true, false) => "yes",
            (false, _) => "NO",
        };
        println!(
            "{:<10}  {slot:>4}  {:<20}  {:<24}  {:<13}  {empty:<12}  {}",
            r.id,
            r.outcome,
            r.detail,
            pid_list(&r.pids),
            if r.dir_gone { "yes" } else { "NO" }
        );
        if !r.proven_empty {
            failures.push(format!("{}: a recorded pid outlived run", r.id));
        }
        if !r.dir_gone {
            failures.push(format!("{}: the temp dir outlived run", r.id));
        }
        if !r.as_expected {
            failures.push(format!("{}: unexpected outcome", r.id));
        }
    }

    // Every slot came back on its own, before any shutdown.
    let stats = sup.stats();
    let quarantined = sup
        .quarantined()
        .await
        .map(|q| q.len())
        .unwrap_or(usize::MAX);
    let all_pids: Vec<i32> = reports
        .iter()
        .flat_map(|r| r.pids.iter().copied())
        .collect();
    let left: Vec<i32> = all_pids.iter().copied().filter(|p| exists(*p)).collect();
    let report = match sup.shutdown().await {
        Ok(report) => Some(report),
        Err(e) => {
            failures.push(format!("shutdown failed: {e}"));
            None
        }
    };
    println!();
    println!("stats before shutdown: {}", stats_line(&stats));
    if let Some(report) = &report {
        println!(
            "shutdown report:       refused_waiters={} cancelled_jobs={} released_leases={} quarantined={}",
            report.refused_waiters,
            report.cancelled_jobs,
            report.released_leases,
            report.quarantined
        );
        println!("stats after shutdown:  {}", stats_line(&report.stats));
        if report.quarantined != 0 {
            failures.push(format!(
                "{} slots quarantined at shutdown",
                report.quarantined
            ));
        }
    }
    println!(
        "recorded pids: {} ({} still in /proc)",
        all_pids.len(),
        left.len()
    );
    if stats.active != 0 || stats.waiting != 0 {
        failures.push(format!("slots not back: {}", stats_line(&stats)));
    }
    if stats.quarantined != 0 || quarantined != 0 {
        failures.push(format!("quarantined slots: {quarantined}"));
    }
    if stats.acquired_total != stats.released_total {
        failures.push(format!("grants not all released: {}", stats_line(&stats)));
    }
    if !left.is_empty() {
        failures.push(format!("pids still present: {}", pid_list(&left)));
    }
    if failures.is_empty() {
        println!("every slot came back, every recorded pid is gone, every temp dir was removed");
        ExitCode::SUCCESS
    } else {
        for f in &failures {
            eprintln!("FAILED: {f}");
        }
        ExitCode::FAILURE
    }
}

/// Runs one job and checks, the moment `run` returns, that its processes and temp dir are gone.
async fn drive(sup: Supervisor, id: &'static str, kind: Kind) -> Report {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut spec = JobSpec::new(id).expect("a valid job id");
    let token = CancellationToken::new();
    if kind.cancelled() {
        spec = spec.with_cancel(token.clone());
    }
    // The body opens the gate once its child has printed its pids. Only then is the job
    // cancelled.
    let (gate_tx, gate_rx) = oneshot::channel::<()>();
    let body = {
        let seen = Arc::clone(&seen);
        move |ctx: WorkerContext| body(ctx, kind, seen, gate_tx)
    };
    let canceller = async {
        if gate_rx.await.is_ok() && kind.cancelled() {
            log(id, "cancel requested (token.cancel())");
            token.cancel();
        }
    };
    let (result, ()) = tokio::join!(sup.run(spec, body), canceller);

    // `run` returns only after the group was proven empty, the temp dir removed and the slot
    // released. Each of these is checked now, with no waiting.
    let stats = sup.stats();
    let (slot, temp_dir, pids) = {
        let seen = seen.lock().unwrap();
        (seen.slot, seen.temp_dir.clone(), seen.pids.clone())
    };
    let (outcome, detail) = match &result {
        Ok(done) => (
            "OK".to_owned(),
            format!("{} unique frames", done.unique_frames),
        ),
        Err(err) => (err.code().to_owned(), describe(err)),
    };
    log(id, format_args!("run returned: {outcome} ({detail})"));
    let left: Vec<i32> = pids.iter().copied().filter(|p| exists(*p)).collect();
    let proven_empty = left.is_empty();
    if pids.is_empty() {
        log(id, "group proven empty: no process was spawned");
    } else if proven_empty {
        let procs: Vec<String> = pids.iter().map(|p| format!("/proc/{p}")).collect();
        log(
            id,
            format_args!("group proven empty: {} gone", procs.join(", ")),
        );
    } else {
        log(
            id,
            format_args!("GROUP NOT EMPTY: {} still present", pid_list(&left)),
        );
    }
    let dir_gone = temp_dir.as_deref().is_none_or(|d| !d.exists());
    match &temp_dir {
        Some(d) if dir_gone => log(id, format_args!("temp dir gone: {}", short(d))),
        Some(d) => log(id, format_args!("TEMP DIR STILL THERE: {}", d.display())),
        None => log(id, "no temp dir was seen"),
    }
    if kind == Kind::Escape {
        let target = sup.work_root().join("escape.txt");
        let verdict = if target.exists() { "EXISTS" } else { "absent" };
        log(
            id,
            format_args!("nothing ran: {} {verdict}", target.display()),
        );
    }
    let released = slot.map_or_else(|| "no slot".to_owned(), |s| format!("slot {s} released"));
    log(
        id,
        format_args!("{released} (run returns after it): {}", stats_line(&stats)),
    );

    let (want_outcome, want_detail) = kind.expected();
    let as_expected = outcome == want_outcome
        && detail == want_detail
        && (kind != Kind::Escape || !sup.work_root().join("escape.txt").exists());
    Report {
        id,
        slot,
        outcome,
        detail,
        pids,
        proven_empty,
        dir_gone,
        as_expected,
    }
}

/// The job body: spawns the job's script (or fails to) and reports what it sees.
async fn body(
    ctx: WorkerContext,
    kind: Kind,
    seen: Arc<Mutex<Seen>>,
    gate: oneshot::Sender<()>,
) -> Result<Done, Failure> {
    let id = ctx.job_id().to_owned();
    {
        let mut seen = seen.lock().unwrap();
        seen.slot = Some(ctx.slot_id());
        seen.temp_dir = Some(ctx.temp_dir().to_path_buf());
    }
    log(
        &id,
        format_args!(
            "started on slot {} (lease {}), temp dir {}",
            ctx.slot_id(),
            ctx.lease_id(),
            short(ctx.temp_dir())
        ),
    );

    let script = match kind {
        Kind::Sort => SORT_SCRIPT,
        Kind::Cancel => CANCEL_SCRIPT,
        Kind::Stubborn => STUBBORN_SCRIPT,
        Kind::Escape => return escape(&ctx, &id),
    };
    let mut child = ctx.spawn_process(
        ProcessSpec::new("sh")
            .arg("-c")
            .arg(script)
            .stdout(Stdio::piped()),
    )?;
    let (leader, helper) = read_pids(&mut child).await?;
    seen.lock().unwrap().pids = vec![leader, helper];
    assert_eq!(leader as u32, child.pid(), "$$ is the spawned leader");
    log(
        &id,
        format_args!("pids recorded: leader {leader} (= its group), helper sleep {helper}"),
    );
    let _ = gate.send(());

    match kind {
        Kind::Sort => {
            let status = child.wait().await?;
            if !status.success() {
                return Err(Failure::Stopped(status));
            }
            let frames =
                std::fs::read_to_string(ctx.path("frames.txt").map_err(io::Error::other)?)?;
            let out = std::fs::read_to_string(ctx.path("out.txt").map_err(io::Error::other)?)?;
            let unique_frames = out.lines().count();
            let helper_state = if exists(helper) {
                "still running: the slot waits for it"
            } else {
                "already gone"
            };
            log(
                &id,
                format_args!(
                    "leader exited 0: {} frames -> {unique_frames} unique in out.txt; helper {helper} {helper_state}",
                    frames.lines().count()
                ),
            );
            Ok(Done { unique_frames })
        }
        Kind::Cancel | Kind::Stubborn => {
            ctx.cancelled().await;
            let since = Instant::now();
            log(&id, "body saw the cancellation; the group gets SIGTERM");
            let status = child.wait().await?;
            let how = status
                .signal()
                .map_or_else(|| status.to_string(), signal_name);
            let grace = if status.signal() == Some(9) {
                format!(" (process grace {} ms)", PROCESS_GRACE.as_millis())
            } else {
                String::new()
            };
            let out = if ctx.path("out.txt").is_ok_and(|p| p.exists()) {
                "out.txt written"
            } else {
                "out.txt never written"
            };
            log(
                &id,
                format_args!(
                    "leader ended by {how} {} ms after the cancellation{grace}; {out}",
                    since.elapsed().as_millis()
                ),
            );
            Err(Failure::Stopped(status))
        }
        Kind::Escape => unreachable!("handled before spawning"),
    }
}

/// The refused job: `../escape.txt` leaves the temp dir, so nothing is spawned.
fn escape(ctx: &WorkerContext, id: &str) -> Result<Done, Failure> {
    let code = ctx
        .path("../escape.txt")
        .map_or_else(|e| e.code(), |_| "accepted");
    log(id, format_args!("ctx.path(\"../escape.txt\") -> {code}"));
    let spec = ProcessSpec::new("sh")
        .arg("-c")
        .arg("echo escaped > \"$1\"")
        .arg("sh")
        .output("../escape.txt");
    match ctx.spawn_process(spec) {
        Err(e) => {
            log(
                id,
                format_args!("spawn_process refused: {} ({e}); nothing spawned", e.code()),
            );
            Err(Failure::Process(e))
        }
        Ok(child) => {
            log(
                id,
                format_args!("spawn_process ACCEPTED ../escape.txt (pid {})", child.pid()),
            );
            Ok(Done { unique_frames: 0 })
        }
    }
}

/// Reads `leader helper` from the child's first line of output.
async fn read_pids(child: &mut JobProcess) -> io::Result<(i32, i32)> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("stdout not piped"))?;
    let line = BufReader::new(stdout)
        .lines()
        .next_line()
        .await?
        .ok_or_else(|| io::Error::other("the child printed no pids"))?;
    let mut pids = line.split_whitespace().map(str::parse::<i32>);
    match (pids.next(), pids.next()) {
        (Some(Ok(leader)), Some(Ok(helper))) => Ok((leader, helper)),
        _ => Err(io::Error::other(format!("unexpected pid line {line:?}"))),
    }
}

/// The temp dir's name inside the work root.
fn short(dir: &Path) -> String {
    dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// The detail of a job error: the body's own error (or the failure's kind) and the cleanup's.
fn describe(err: &JobError<Failure>) -> String {
    let mut parts = Vec::new();
    if let Some(body) = err.body_error() {
        parts.push(match body.error() {
            Some(e) => e.to_string(),
            None => body.to_string(),
        });
    }
    if let Some(cleanup) = err.cleanup_error() {
        parts.push(format!("cleanup: {cleanup}"));
    }
    if parts.is_empty() {
        parts.push(err.to_string());
    }
    parts.join("; ")
}
