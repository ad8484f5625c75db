//! Two processes sharing one pool of slots through etcd, printing every grant with its fencing
//! token.
//!
//! Each process runs a leasehold [`Supervisor`] on an [`EtcdBroker`]: the pool (`demo`, 2 slots
//! by default) lives in etcd, so the two processes together never hold more than its slots at
//! once, and each waits in one FIFO queue with the other. A job prints its grant — which slot,
//! and the token's lease id, the etcd create revision of the slot key, strictly increasing across
//! the whole pool, so a fencing token — works for 150–300 ms, checks its token with a
//! [`FencingGuard`] (one per slot, shared by the process's jobs) before "writing its output",
//! and prints when it is done. Lines from both processes interleave on one terminal.
//!
//! # Run it in one command
//!
//! ```sh
//! cargo run --features etcd --example distributed
//! ```
//!
//! starts a throwaway etcd (the `etcd` binary on `PATH`, or `--etcd-bin PATH`; `apt-get install
//! etcd-server` provides one) on free loopback ports with a temporary data dir, starts a second
//! copy of itself as process `B` and runs as process `A`, six jobs each. At the end it checks
//! both processes' grants: every job succeeded, the fencing tokens increase strictly in grant
//! order on every slot, never more jobs held a slot at once than there are slots, and every
//! slot key in etcd is gone. It exits non-zero when one of these does not hold, and stops etcd
//! (and the child) in every case.
//!
//! # Run it by hand, in two terminals
//!
//! With an etcd of your own (`etcd` alone serves `http://127.0.0.1:2379`):
//!
//! ```sh
//! cargo run --features etcd --example distributed -- --endpoint http://127.0.0.1:2379 --name A
//! cargo run --features etcd --example distributed -- --endpoint http://127.0.0.1:2379 --name B
//! ```
//!
//! With `--endpoint` a process runs its own jobs only and checks its own grants (and that none
//! of its slot keys is left in etcd); start both within a second or two to see them share the
//! slots. Kill one with `kill -9` while it holds a slot: the other gets that slot once the
//! killed holder's lease TTL (`--ttl`, 5 s here) has run out. Options: `--pool`, `--slots`,
//! `--jobs`, `--ttl`, `--key-prefix`, `--etcd-bin` (`--help`).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::{self, File};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use etcd_client::GetOptions;
use futures_util::future::join_all;
use leasehold::{
    EtcdBroker, EtcdConfig, FencingGuard, JobError, JobSpec, StaleToken, Supervisor, WorkerContext,
};
use serde_json::{Value, json};
use tempfile::TempDir;

/// How long the throwaway etcd may take to say `"health":"true"`.
const HEALTH_LIMIT: Duration = Duration::from_secs(30);
/// How many times the throwaway etcd is started on fresh ports when it exits early.
const START_ATTEMPTS: usize = 5;
/// How long the parent waits for its child after its own jobs are done.
const CHILD_LIMIT: Duration = Duration::from_secs(120);
/// Bound of the final read of the pool's slot keys.
const CHECK_LIMIT: Duration = Duration::from_secs(5);

/// Two processes sharing one pool of slots through etcd.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    /// Use the etcd at URL and run this process only (start a second one by hand). Without it,
    /// a throwaway etcd is started and a second copy of this program runs next to this one.
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// This process's name, in job ids and output lines ([A-Za-z0-9_-], at most 32 characters).
    /// Default: `A` when this process starts etcd itself, else `p<pid>`.
    #[arg(long)]
    name: Option<String>,
    /// The pool both processes share.
    #[arg(long, default_value = "demo")]
    pool: String,
    /// Slots in the pool (every process of the pool must say the same).
    #[arg(long, default_value_t = 2)]
    slots: u32,
    /// Jobs this process runs (each process runs this many).
    #[arg(long, default_value_t = 6)]
    jobs: u32,
    /// Lease TTL in whole seconds: how soon a killed holder's slot comes back.
    #[arg(long, default_value_t = 5, value_name = "SECS")]
    ttl: u64,
    /// etcd key prefix under which the pool lives.
    #[arg(long, default_value = "leasehold", value_name = "PREFIX")]
    key_prefix: String,
    /// The etcd binary to start (default: `etcd` on PATH). Ignored with --endpoint.
    #[arg(long, value_name = "PATH")]
    etcd_bin: Option<PathBuf>,
    /// Write this process's grants and result as JSON to FILE (the parent passes it to its
    /// child, and reads it back for the summary).
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
}

/// One grant as a job saw it: from the moment its body started to the moment it ended, the
/// job held `slot` under `token`.
#[derive(Debug, Clone)]
struct Grant {
    job: String,
    slot: u32,
    token: u64,
    /// Microseconds since the Unix epoch (both processes run on this host, on one clock).
    start_us: u64,
    end_us: u64,
    fenced: bool,
}

/// What one process reports at the end.
#[derive(Debug, Default)]
struct Outcome {
    name: String,
    /// The pool's key prefix, as the broker reported it (empty when it never connected).
    prefix: String,
    grants: Vec<Grant>,
    /// `job CODE: detail` for every job that did not succeed.
    failed: Vec<String>,
    /// Anything else that went wrong (stats that do not add up, slot keys left behind).
    problems: Vec<String>,
    acquired_total: u64,
    released_total: u64,
    orphan_expired_total: u64,
}

/// Why a job body failed.
#[derive(Debug)]
enum Failure {
    /// The guard has already accepted a newer token for this slot: this holder lost its lease.
    Fenced(StaleToken),
    /// The job was cancelled (its lease could not be renewed, or shutdown).
    Cancelled,
    /// The broker granted a slot outside `0..slots`.
    UnknownSlot(u32),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fenced(stale) => write!(f, "{}: {stale}", stale.code()),
            Self::Cancelled => f.write_str("cancelled before its work was done"),
            Self::UnknownSlot(slot) => write!(f, "granted slot {slot}, outside the pool"),
        }
    }
}

impl std::error::Error for Failure {}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(msg) = check_args(&args) {
        eprintln!("distributed: {msg}");
        return ExitCode::from(2);
    }
    match args.endpoint.clone() {
        Some(endpoint) => {
            let name = args
                .name
                .clone()
                .unwrap_or_else(|| format!("p{}", std::process::id()));
            single(&args, &endpoint, &name).await
        }
        None => orchestrate(&args).await,
    }
}

fn check_args(args: &Args) -> Result<(), String> {
    if let Some(name) = &args.name {
        let ok = !name.is_empty()
            && name.len() <= 32
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
        if !ok {
            return Err(format!(
                "--name {name:?} must be 1-32 characters of [A-Za-z0-9_-]"
            ));
        }
    }
    if args.slots == 0 {
        return Err("--slots must be at least 1".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// One process: its own jobs on the shared pool
// ---------------------------------------------------------------------------------------------

/// `--endpoint` mode: this process's jobs, its own checks, and its report file if asked for.
async fn single(args: &Args, endpoint: &str, name: &str) -> ExitCode {
    let outcome = match run_process(args, endpoint, name).await {
        Ok(outcome) => outcome,
        Err(msg) => {
            say(format!("[{name}] FAILED: {msg}"));
            if let Some(path) = &args.report {
                // The parent reads a report either way; an empty one says "nothing ran".
                let failed = Outcome {
                    name: name.to_owned(),
                    problems: vec![msg],
                    ..Outcome::default()
                };
                let _ = write_report(path, &failed);
            }
            return ExitCode::FAILURE;
        }
    };
    let mut failures = outcome.failed.clone();
    failures.extend(outcome.problems.iter().cloned());
    failures.extend(check_grants(
        std::slice::from_ref(&outcome),
        args.slots,
        false,
    ));
    if let Some(path) = &args.report
        && let Err(e) = write_report(path, &outcome)
    {
        failures.push(format!("cannot write the report {}: {e}", path.display()));
    }
    if failures.is_empty() {
        if args.report.is_none() {
            // Run by hand: the summary of both processes is the parent's in the default mode.
            say(format!(
                "[{name}] {} grants, fencing tokens strictly increasing per slot, at most {} of {} slots held at once by this process",
                outcome.grants.len(),
                max_concurrent(outcome.grants.iter()),
                args.slots
            ));
        }
        ExitCode::SUCCESS
    } else {
        for f in &failures {
            say(format!("[{name}] FAILED: {f}"));
        }
        ExitCode::FAILURE
    }
}

/// Connects, runs this process's jobs concurrently on a supervisor over the etcd pool, prints
/// its stats and shuts it down. `Err` only when nothing could run at all.
async fn run_process(args: &Args, endpoint: &str, name: &str) -> Result<Outcome, String> {
    let config = EtcdConfig::new([endpoint], args.pool.clone(), args.slots)
        .key_prefix(args.key_prefix.clone())
        .ttl(Duration::from_secs(args.ttl))
        .rpc_timeout(Duration::from_secs(2))
        .retry_for(Duration::from_secs(10));
    let broker = EtcdBroker::connect(config).await.map_err(|e| {
        format!(
            "cannot connect to etcd at {endpoint}: {} ({})",
            e.code(),
            e.message()
        )
    })?;
    // The builder takes the broker by value: keep what is needed of it afterwards now.
    let prefix = broker.pool_prefix().to_owned();
    let sup = Supervisor::builder()
        .broker(broker)
        .start()
        .await
        .map_err(|e| format!("cannot start the supervisor: {} ({e})", e.code()))?;
    say(format!(
        "[{name}] pid {} connected to {endpoint}: pool {prefix} with {} slots, {} jobs to run",
        std::process::id(),
        args.slots,
        args.jobs
    ));

    // The protected resource here is each slot's output: one guard per slot, shared by every
    // job of this process. (One guard for both slots would refuse a job whose slot-mate on the
    // other slot, granted later, happened to write first.)
    let guards: Arc<Vec<FencingGuard>> =
        Arc::new((0..args.slots).map(|_| FencingGuard::new()).collect());
    let grants: Arc<Mutex<Vec<Grant>>> = Arc::new(Mutex::new(Vec::new()));
    let mut outcome = Outcome {
        name: name.to_owned(),
        prefix: prefix.clone(),
        ..Outcome::default()
    };
    let random = std::hash::RandomState::new();

    // The futures are polled in order on their first poll, so the jobs join the queue in
    // order; the bodies run in worker actors, not here.
    let mut runs = Vec::new();
    for n in 1..=args.jobs {
        let id = format!("{name}-{n}");
        let spec = match JobSpec::new(id.as_str()) {
            Ok(spec) => spec,
            Err(e) => {
                outcome.failed.push(format!("{id} {}: {e}", e.code()));
                continue;
            }
        };
        let work = {
            let mut h = random.build_hasher();
            h.write_u32(n);
            Duration::from_millis(150 + h.finish() % 151)
        };
        let body = {
            let (name, id) = (name.to_owned(), id.clone());
            let (guards, grants) = (Arc::clone(&guards), Arc::clone(&grants));
            move |ctx: WorkerContext| job_body(ctx, name, id, work, guards, grants)
        };
        let sup = &sup;
        runs.push(async move {
            let result = sup.run(spec, body).await;
            let failed = result
                .err()
                .map(|err| format!("{id} {}: {}", err.code(), describe(&err)));
            if let Some(line) = &failed {
                say(format!("[{name}] job {line}"));
            }
            failed
        });
    }
    outcome
        .failed
        .extend(join_all(runs).await.into_iter().flatten());

    let stats = sup.stats();
    say(format!(
        "[{name}] stats: acquired_total={} released_total={} orphan_expired_total={} release_failed_total={} active={}",
        stats.acquired_total,
        stats.released_total,
        stats.orphan_expired_total,
        stats.release_failed_total,
        stats.active
    ));
    outcome.acquired_total = stats.acquired_total;
    outcome.released_total = stats.released_total;
    outcome.orphan_expired_total = stats.orphan_expired_total;
    if stats.acquired_total != stats.released_total || stats.active != 0 {
        outcome.problems.push(format!(
            "not every grant was released: acquired {} released {} active {}",
            stats.acquired_total, stats.released_total, stats.active
        ));
    }
    match sup.shutdown().await {
        Ok(report) if report.quarantined != 0 => outcome.problems.push(format!(
            "{} slots quarantined at shutdown",
            report.quarantined
        )),
        Ok(_) => {}
        Err(e) => outcome
            .problems
            .push(format!("shutdown failed: {} ({e})", e.code())),
    }

    outcome.grants = grants.lock().map(|g| g.clone()).unwrap_or_default();
    outcome.grants.sort_by_key(|g| g.start_us);
    // None of this process's slot keys may be left in etcd: a slot key's create revision is
    // the token it was granted under.
    let mine: HashSet<u64> = outcome.grants.iter().map(|g| g.token).collect();
    match held_slots(endpoint, &prefix).await {
        Ok(held) => {
            for (key, revision) in held.iter().filter(|(_, r)| mine.contains(r)) {
                outcome
                    .problems
                    .push(format!("{key} is still held under token {revision}"));
            }
        }
        Err(msg) => outcome.problems.push(msg),
    }
    Ok(outcome)
}

/// One job: print the grant, work, pass the fencing guard, "write" the output.
async fn job_body(
    ctx: WorkerContext,
    name: String,
    id: String,
    work: Duration,
    guards: Arc<Vec<FencingGuard>>,
    grants: Arc<Mutex<Vec<Grant>>>,
) -> Result<(), Failure> {
    let start_us = now_us();
    let token = ctx.token();
    let (slot, lease) = (token.slot_id(), token.lease_id());
    say(format!(
        "[{name}] job {id} granted slot {slot}, fencing token {lease}"
    ));
    let record = |fenced: bool| {
        let grant = Grant {
            job: id.clone(),
            slot,
            token: lease,
            start_us,
            end_us: now_us(),
            fenced,
        };
        if let Ok(mut grants) = grants.lock() {
            grants.push(grant);
        }
    };

    // The "work". A real body would do it in a select! next to `cancelled` just the same: the
    // supervisor cancels the job when its lease cannot be renewed.
    tokio::select! {
        () = tokio::time::sleep(work) => {}
        () = ctx.cancelled() => {
            record(false);
            return Err(Failure::Cancelled);
        }
    }

    // Before writing, the protected side checks the token: a holder whose lease was lost (and
    // whose slot went to a newer holder) is refused here.
    let Some(guard) = guards.get(slot as usize) else {
        record(false);
        return Err(Failure::UnknownSlot(slot));
    };
    if let Err(stale) = guard.check(token) {
        record(true);
        say(format!(
            "[{name}] job {id} REFUSED by slot {slot}'s fencing guard: {} (token {}, newest {}); output not written",
            stale.code(),
            stale.token(),
            stale.newest()
        ));
        return Err(Failure::Fenced(stale));
    }
    record(false);
    say(format!(
        "[{name}] job {id} done (slot {slot}, token {lease})"
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The default mode: a throwaway etcd, a child process, and the summary of both
// ---------------------------------------------------------------------------------------------

async fn orchestrate(args: &Args) -> ExitCode {
    let started = Instant::now();
    let name = args.name.clone().unwrap_or_else(|| "A".to_owned());
    let child_name = if name == "B" { "C" } else { "B" };

    let Some(bin) = find_etcd(args.etcd_bin.as_deref()) else {
        let searched = args
            .etcd_bin
            .as_ref()
            .map_or_else(|| "on PATH".to_owned(), |p| format!("at {}", p.display()));
        eprintln!(
            "distributed: no etcd binary found {searched}.\n\
             This example starts a throwaway etcd server of its own. Install one\n\
             \x20   sudo apt-get install etcd-server    (Debian/Ubuntu; other systems: a release from\n\
             \x20                                        https://github.com/etcd-io/etcd/releases)\n\
             and run it again (or name the binary with --etcd-bin PATH), or use an etcd that is\n\
             already running, with one process per terminal:\n\
             \x20   cargo run --features etcd --example distributed -- --endpoint http://127.0.0.1:2379 --name A\n\
             \x20   cargo run --features etcd --example distributed -- --endpoint http://127.0.0.1:2379 --name B"
        );
        return ExitCode::from(2);
    };

    // Everything below is stopped (etcd killed and reaped, its data dir removed; the child
    // killed and reaped) when these guards drop, on every path out of this function.
    let etcd = match LocalEtcd::start(&bin) {
        Ok(etcd) => etcd,
        Err(msg) => {
            eprintln!("distributed: {msg}");
            return ExitCode::FAILURE;
        }
    };
    let endpoint = etcd.endpoint();
    say(format!(
        "[{name}] started {} (pid {}) at {endpoint}, data in {}",
        bin.display(),
        etcd.pid(),
        etcd.dir.path().display()
    ));

    let report_path = etcd.dir.path().join(format!("report-{child_name}.json"));
    let mut child = match spawn_child(args, &endpoint, child_name, &report_path) {
        Ok(child) => child,
        Err(e) => {
            eprintln!("distributed: cannot start the second process: {e}");
            return ExitCode::FAILURE;
        }
    };
    say(format!(
        "[{name}] started process {child_name} (pid {}) on the same pool",
        child.pid()
    ));

    let mut failures = Vec::new();
    let mine = match run_process(args, &endpoint, &name).await {
        Ok(outcome) => outcome,
        Err(msg) => {
            failures.push(msg);
            Outcome {
                name: name.clone(),
                ..Outcome::default()
            }
        }
    };

    match child.wait_for(CHILD_LIMIT).await {
        Ok(status) if status.success() => {}
        Ok(status) => failures.push(format!("process {child_name} ended with {status}")),
        Err(e) => failures.push(format!("process {child_name}: {e}")),
    }
    let theirs = match read_report(&report_path) {
        Ok(outcome) => outcome,
        Err(e) => {
            failures.push(format!(
                "cannot read {child_name}'s report {}: {e}",
                report_path.display()
            ));
            Outcome {
                name: child_name.to_owned(),
                ..Outcome::default()
            }
        }
    };
    // The prefix the broker reported (`pool_prefix()`); spelled out only if A never connected.
    let prefix = if mine.prefix.is_empty() {
        format!("{}/{}/", args.key_prefix, args.pool)
    } else {
        mine.prefix.clone()
    };
    let held = match held_slots(&endpoint, &prefix).await {
        Ok(held) => held,
        Err(msg) => {
            failures.push(msg);
            Vec::new()
        }
    };
    drop(child);
    drop(etcd);

    let outcomes = [mine, theirs];
    for o in &outcomes {
        failures.extend(o.failed.iter().map(|f| format!("[{}] job {f}", o.name)));
        failures.extend(o.problems.iter().map(|p| format!("[{}] {p}", o.name)));
    }
    failures.extend(check_grants(&outcomes, args.slots, true));
    failures.extend(
        held.iter()
            .map(|(key, rev)| format!("{key} still held at the end (token {rev})")),
    );

    summary(&outcomes, args.slots, &held, started.elapsed());
    if failures.is_empty() {
        say("every job succeeded, every token passed its slot's guard, every slot is free".into());
        ExitCode::SUCCESS
    } else {
        for f in &failures {
            say(format!("FAILED: {f}"));
        }
        ExitCode::FAILURE
    }
}

/// Prints the grants of both processes per slot, in grant order, and the totals.
fn summary(outcomes: &[Outcome], slots: u32, held: &[(String, u64)], took: Duration) {
    let grants: Vec<(&str, &Grant)> = outcomes
        .iter()
        .flat_map(|o| o.grants.iter().map(move |g| (o.name.as_str(), g)))
        .collect();
    say(String::new());
    say(format!(
        "summary: {} grants in total ({}), at most {} of {slots} slots held at once",
        grants.len(),
        outcomes
            .iter()
            .map(|o| format!("{} {}", o.name, o.grants.len()))
            .collect::<Vec<_>>()
            .join(", "),
        max_concurrent(grants.iter().map(|(_, g)| *g))
    ));
    let mut per_slot: BTreeMap<u32, Vec<&Grant>> = BTreeMap::new();
    for (_, g) in &grants {
        per_slot.entry(g.slot).or_default().push(g);
    }
    for (slot, mut list) in per_slot {
        list.sort_by_key(|g| g.start_us);
        let increasing = list.windows(2).all(|w| w[0].token < w[1].token);
        say(format!(
            "  slot {slot}: {}  ({})",
            list.iter()
                .map(|g| format!("{}:{}", g.job, g.token))
                .collect::<Vec<_>>()
                .join(" < "),
            if increasing {
                "tokens strictly increasing in grant order"
            } else {
                "TOKENS NOT INCREASING"
            }
        ));
    }
    for o in outcomes {
        say(format!(
            "  {}: acquired_total={} released_total={} orphan_expired_total={}",
            o.name, o.acquired_total, o.released_total, o.orphan_expired_total
        ));
    }
    if held.is_empty() {
        say("  etcd: no slot key left under the pool: every slot is free".into());
    } else {
        say(format!("  etcd: {} slot keys still held", held.len()));
    }
    say(format!("  took {:.2} s", took.as_secs_f64()));
}

/// Every check on a set of grants; one line per violation. `complete` says that these are all
/// the grants of the pool (the default mode), so tokens must also be unique pool-wide.
fn check_grants(outcomes: &[Outcome], slots: u32, complete: bool) -> Vec<String> {
    let mut failures = Vec::new();
    let all: Vec<(&str, &Grant)> = outcomes
        .iter()
        .flat_map(|o| o.grants.iter().map(move |g| (o.name.as_str(), g)))
        .collect();
    let mut per_slot: BTreeMap<u32, Vec<&Grant>> = BTreeMap::new();
    for (name, g) in &all {
        if g.slot >= slots {
            failures.push(format!(
                "[{name}] {} was granted slot {} of {slots}",
                g.job, g.slot
            ));
        }
        if g.fenced {
            failures.push(format!("[{name}] {} was fenced off", g.job));
        }
        per_slot.entry(g.slot).or_default().push(g);
    }
    for (slot, mut list) in per_slot {
        list.sort_by_key(|g| g.start_us);
        for w in list.windows(2) {
            if w[1].token <= w[0].token {
                failures.push(format!(
                    "slot {slot}: {} got token {} after {} got token {}",
                    w[1].job, w[1].token, w[0].job, w[0].token
                ));
            }
            if w[1].start_us < w[0].end_us {
                failures.push(format!(
                    "slot {slot}: {} started before {} had ended",
                    w[1].job, w[0].job
                ));
            }
        }
    }
    if complete {
        let mut seen = HashSet::new();
        for (name, g) in &all {
            if !seen.insert(g.token) {
                failures.push(format!(
                    "[{name}] {}: token {} granted twice",
                    g.job, g.token
                ));
            }
        }
    }
    let most = max_concurrent(all.iter().map(|(_, g)| *g));
    if most > slots as usize {
        failures.push(format!(
            "{most} jobs held a slot at once, with {slots} slots"
        ));
    }
    failures
}

/// The most grants whose [start, end] intervals overlap at one instant.
fn max_concurrent<'a>(grants: impl Iterator<Item = &'a Grant>) -> usize {
    // An end sorts before a start at the same instant: the slot was handed over.
    let mut events: Vec<(u64, i8)> = grants
        .flat_map(|g| [(g.start_us, 1), (g.end_us, -1)])
        .collect();
    events.sort();
    let (mut now, mut most) = (0i64, 0i64);
    for (_, delta) in events {
        now += i64::from(delta);
        most = most.max(now);
    }
    usize::try_from(most).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// The child process and its report
// ---------------------------------------------------------------------------------------------

/// The second process: killed and reaped when dropped before it has ended.
struct ChildProcess {
    child: Child,
}

fn spawn_child(args: &Args, endpoint: &str, name: &str, report: &Path) -> io::Result<ChildProcess> {
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .arg("--endpoint")
        .arg(endpoint)
        .arg("--name")
        .arg(name)
        .arg("--pool")
        .arg(&args.pool)
        .arg("--slots")
        .arg(args.slots.to_string())
        .arg("--jobs")
        .arg(args.jobs.to_string())
        .arg("--ttl")
        .arg(args.ttl.to_string())
        .arg("--key-prefix")
        .arg(&args.key_prefix)
        .arg("--report")
        .arg(report)
        .stdin(Stdio::null())
        .spawn()?;
    Ok(ChildProcess { child })
}

impl ChildProcess {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the child to exit on its own, up to `limit`; then kills it.
    async fn wait_for(&mut self, limit: Duration) -> io::Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("still running after {limit:?}; killed"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn write_report(path: &Path, o: &Outcome) -> io::Result<()> {
    let grants: Vec<Value> = o
        .grants
        .iter()
        .map(|g| {
            json!({
                "job": g.job, "slot": g.slot, "token": g.token,
                "start_us": g.start_us, "end_us": g.end_us, "fenced": g.fenced,
            })
        })
        .collect();
    let doc = json!({
        "name": o.name,
        "prefix": o.prefix,
        "grants": grants,
        "failed": o.failed,
        "problems": o.problems,
        "acquired_total": o.acquired_total,
        "released_total": o.released_total,
        "orphan_expired_total": o.orphan_expired_total,
    });
    // Written whole under another name, then renamed: the parent never reads half a file.
    let tmp = path.with_extension("partial");
    fs::write(&tmp, serde_json::to_vec_pretty(&doc)?)?;
    fs::rename(&tmp, path)
}

fn read_report(path: &Path) -> io::Result<Outcome> {
    let doc: Value = serde_json::from_slice(&fs::read(path)?)?;
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("no valid {what}"));
    let strings = |key: &str| -> io::Result<Vec<String>> {
        doc[key]
            .as_array()
            .ok_or_else(|| bad(key))?
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| bad(key)))
            .collect()
    };
    let number = |v: &Value, key: &str| v[key].as_u64().ok_or_else(|| bad(key));
    let mut grants = Vec::new();
    for g in doc["grants"].as_array().ok_or_else(|| bad("grants"))? {
        grants.push(Grant {
            job: g["job"].as_str().ok_or_else(|| bad("job"))?.to_owned(),
            slot: u32::try_from(number(g, "slot")?).map_err(|_| bad("slot"))?,
            token: number(g, "token")?,
            start_us: number(g, "start_us")?,
            end_us: number(g, "end_us")?,
            fenced: g["fenced"].as_bool().ok_or_else(|| bad("fenced"))?,
        });
    }
    Ok(Outcome {
        name: doc["name"].as_str().ok_or_else(|| bad("name"))?.to_owned(),
        prefix: doc["prefix"]
            .as_str()
            .ok_or_else(|| bad("prefix"))?
            .to_owned(),
        grants,
        failed: strings("failed")?,
        problems: strings("problems")?,
        acquired_total: number(&doc, "acquired_total")?,
        released_total: number(&doc, "released_total")?,
        orphan_expired_total: number(&doc, "orphan_expired_total")?,
    })
}

// ---------------------------------------------------------------------------------------------
// etcd: the throwaway server, and the final read of the slot keys
// ---------------------------------------------------------------------------------------------

/// The slot keys under `pool_prefix` (`{key_prefix}/{pool}/`) that are still in etcd, with
/// their create revisions (the token each was granted under).
async fn held_slots(endpoint: &str, pool_prefix: &str) -> Result<Vec<(String, u64)>, String> {
    let prefix = format!("{pool_prefix}slot/");
    let read = async {
        let mut client = etcd_client::Client::connect([endpoint], None).await?;
        client
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
    };
    match tokio::time::timeout(CHECK_LIMIT, read).await {
        Ok(Ok(resp)) => Ok(resp
            .kvs()
            .iter()
            .map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                (key, u64::try_from(kv.create_revision()).unwrap_or(0))
            })
            .collect()),
        Ok(Err(e)) => Err(format!("cannot read {prefix}* from {endpoint}: {e}")),
        Err(_) => Err(format!(
            "cannot read {prefix}* from {endpoint}: no answer within {CHECK_LIMIT:?}"
        )),
    }
}

/// `--etcd-bin` if it is an executable file, else `etcd` on `PATH`.
fn find_etcd(explicit: Option<&Path>) -> Option<PathBuf> {
    let executable = |p: &Path| {
        fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    match explicit {
        Some(bin) => executable(bin).then(|| bin.to_path_buf()),
        None => std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("etcd"))
                .find(|candidate| executable(candidate))
        }),
    }
}

/// A single-member etcd on free loopback ports, its data and log in a temp dir. Dropping it
/// kills and reaps etcd, then removes the dir.
struct LocalEtcd {
    child: Child,
    client_port: u16,
    // Declared last: dropped after `Drop::drop` has stopped etcd.
    dir: TempDir,
}

impl LocalEtcd {
    fn start(bin: &Path) -> Result<Self, String> {
        let mut last = String::new();
        for attempt in 1..=START_ATTEMPTS {
            // Fresh ports and a fresh data dir each time: a port taken between our bind and
            // etcd's makes it exit at once.
            let dir = tempfile::Builder::new()
                .prefix("leasehold-distributed-")
                .tempdir()
                .map_err(|e| format!("cannot create a temp dir for etcd: {e}"))?;
            let (client_port, peer_port) =
                free_ports().map_err(|e| format!("cannot find free loopback ports: {e}"))?;
            let log_path = dir.path().join("etcd.log");
            let log = File::create(&log_path)
                .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
            let log_err = log
                .try_clone()
                .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
            let client = format!("http://127.0.0.1:{client_port}");
            let peer = format!("http://127.0.0.1:{peer_port}");
            let child = Command::new(bin)
                .arg("--name")
                .arg("demo")
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .arg("--listen-client-urls")
                .arg(&client)
                .arg("--advertise-client-urls")
                .arg(&client)
                .arg("--listen-peer-urls")
                .arg(&peer)
                .arg("--initial-advertise-peer-urls")
                .arg(&peer)
                .arg("--initial-cluster")
                .arg(format!("demo={peer}"))
                .arg("--logger")
                .arg("zap")
                .arg("--log-outputs")
                .arg("stderr")
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err)
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
            let mut etcd = LocalEtcd {
                child,
                client_port,
                dir,
            };
            match etcd.wait_healthy() {
                Ok(()) => return Ok(etcd),
                Err(Some(status)) => {
                    last = format!(
                        "etcd exited at once ({status}) on ports {client_port}/{peer_port}; log:\n{}",
                        tail(&log_path, 10)
                    );
                    eprintln!("distributed: attempt {attempt}: {last}");
                }
                Err(None) => {
                    return Err(format!(
                        "etcd did not become healthy within {HEALTH_LIMIT:?} at {}; log:\n{}",
                        etcd.endpoint(),
                        tail(&log_path, 20)
                    ));
                }
            }
        }
        Err(format!(
            "etcd failed to start {START_ATTEMPTS} times; last: {last}"
        ))
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `GET /health` until it says `"health":"true"`. `Err(Some(status))` when etcd
    /// exited first, `Err(None)` when it is still not healthy after `HEALTH_LIMIT`.
    fn wait_healthy(&mut self) -> Result<(), Option<ExitStatus>> {
        let deadline = Instant::now() + HEALTH_LIMIT;
        let mut pause = Duration::from_millis(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Some(status));
            }
            let answer = http_get(self.client_port, "/health", Duration::from_secs(1));
            if answer
                .is_ok_and(|r| r.starts_with("HTTP/1.1 200") && r.contains(r#""health":"true""#))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(None);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        // SIGKILL: a throwaway server, nothing in it is kept.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two distinct free loopback ports (bound to 127.0.0.1:0 together, then released).
fn free_ports() -> io::Result<(u16, u16)> {
    let a = TcpListener::bind("127.0.0.1:0")?;
    let b = TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// A plain HTTP/1.1 GET on a fresh connection; the whole response as text.
fn http_get(port: u16, path: &str, timeout: Duration) -> io::Result<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// The last `n` lines of a log file.
fn tail(path: &Path, n: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/// Prints one line and flushes it at once, so that the lines of two processes sharing a
/// terminal interleave whole and in order.
fn say(line: String) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The body's failure and the cleanup's, when present.
fn describe(err: &JobError<Failure>) -> String {
    let mut parts = Vec::new();
    if let Some(body) = err.body_error() {
        parts.push(match body.error() {
            Some(e) => format!("{body}: {e}"),
            None => body.to_string(),
        });
    }
    if let Some(cleanup) = err.cleanup_error() {
        match std::error::Error::source(cleanup) {
            Some(cause) => parts.push(format!("cleanup {}: {cleanup}: {cause}", cleanup.code())),
            None => parts.push(format!("cleanup {}: {cleanup}", cleanup.code())),
        }
    }
    if let Some(acquire) = err.acquire_error() {
        match std::error::Error::source(acquire) {
            Some(cause) => parts.push(format!("{acquire}: {cause}")),
            None => parts.push(acquire.to_string()),
        }
    }
    if parts.is_empty() {
        parts.push(err.to_string());
    }
    parts.join("; ")
}
