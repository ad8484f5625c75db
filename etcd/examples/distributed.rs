//! Two processes sharing one pool of slots through etcd, printing every grant with its fencing
//! token.
//!
//! Each process runs a leasehold [`Supervisor`] on an [`EtcdBroker`]: the pool (`demo`, 2 slots
//! by default) lives in etcd, so the two processes together never hold more than its slots at
//! once, and they wait in one FIFO queue. A job prints its grant (the slot, and the token: the
//! revision of the grant, strictly increasing across the whole etcd cluster), works for
//! 150–300 ms, passes its slot's [`FencingGuard`] before "writing its output", and prints when
//! it is done. Lines from both processes interleave on one terminal.
//!
//! # Run it in one command
//!
//! ```sh
//! cargo run -p leasehold-etcd --example distributed
//! ```
//!
//! starts a throwaway etcd (the `etcd` binary on `PATH`, or `--etcd-bin PATH`; `apt-get install
//! etcd-server` provides one) on free loopback ports with a temporary data dir (the launcher the
//! tests use), starts a second copy of itself as process `B` and runs as process `A`, six jobs
//! each. At the end it checks both processes' grants: every job succeeded, tokens increase
//! strictly on every slot, never more jobs held a slot at once than there are slots, and no
//! slot key is left in etcd. It exits non-zero when one of these does not hold, and stops etcd
//! and the child in every case.
//!
//! # Run it by hand, in two terminals
//!
//! ```sh
//! cargo run -p leasehold-etcd --example distributed -- --endpoint http://127.0.0.1:2379 --name A
//! cargo run -p leasehold-etcd --example distributed -- --endpoint http://127.0.0.1:2379 --name B
//! ```
//!
//! With `--endpoint` (repeat it for each member of a cluster) a process runs its own jobs and
//! checks its own grants. Kill one with `kill -9` while it holds a slot: the other gets that
//! slot once the killed process's session TTL (`--ttl`, 5 s here) has run out. Options:
//! `--pool`, `--slots`, `--jobs`, `--ttl`, `--key-prefix`, `--etcd-bin` (`--help`).

#[allow(dead_code, unreachable_pub)]
#[path = "../tests/etcd_support/server.rs"]
mod etcd_server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use etcd_client::GetOptions;
use futures_util::future::join_all;
use leasehold::{FencingGuard, JobSpec, Supervisor, WorkerContext};
use leasehold_etcd::{EtcdBroker, EtcdConfig};

/// Two processes sharing one pool of slots through etcd.
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    /// Use the etcd member at URL (repeat for each member) and run this process only. Without
    /// it, a throwaway etcd is started and a second copy of this program runs next to this one.
    #[arg(long, value_name = "URL")]
    endpoint: Vec<String>,
    /// This process's name, in job ids and output lines ([A-Za-z0-9_-], at most 32 characters).
    #[arg(long)]
    name: Option<String>,
    /// The pool both processes share.
    #[arg(long, default_value = "demo")]
    pool: String,
    /// Slots in the pool (every process of the pool must say the same).
    #[arg(long, default_value_t = 2)]
    slots: u32,
    /// Jobs this process runs.
    #[arg(long, default_value_t = 6)]
    jobs: u32,
    /// Session TTL in whole seconds: how soon a killed process's slots come back.
    #[arg(long, default_value_t = 5, value_name = "SECS")]
    ttl: u64,
    /// etcd key prefix under which the pool lives.
    #[arg(long, default_value = "leasehold", value_name = "PREFIX")]
    key_prefix: String,
    /// The etcd binary to start (default: `etcd` on PATH). Ignored with --endpoint.
    #[arg(long, value_name = "PATH")]
    etcd_bin: Option<PathBuf>,
    /// Write this process's grants to FILE (the parent passes it to its child).
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
}

/// One grant as a job saw it: from its body's start to its end it held `slot` under `token`.
#[derive(Debug, Clone)]
struct Grant {
    job: String,
    slot: u32,
    token: u64,
    start_us: u64,
    end_us: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.len() <= 32
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if args.name.as_deref().is_some_and(|n| !name_ok(n)) || args.slots == 0 {
        eprintln!(
            "distributed: --name must be 1-32 characters of [A-Za-z0-9_-], --slots at least 1"
        );
        return ExitCode::from(2);
    }
    if args.endpoint.is_empty() {
        return two_processes(&args).await;
    }
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| format!("p{}", std::process::id()));
    let (grants, mut problems) = run_jobs(&args, &args.endpoint, &name).await;
    if let Some(path) = &args.report {
        let mut text = String::new();
        for g in &grants {
            text += &format!(
                "grant {} {} {} {} {}\n",
                g.job, g.slot, g.token, g.start_us, g.end_us
            );
        }
        for p in &problems {
            text += &format!("problem {p}\n");
        }
        if let Err(e) = std::fs::write(path, text) {
            problems.push(format!("cannot write {}: {e}", path.display()));
        }
    } else {
        problems.extend(check(&grants, args.slots));
        if problems.is_empty() {
            say(format!(
                "[{name}] {} grants, tokens strictly increasing per slot, at most {} of {} slots held at once",
                grants.len(),
                max_concurrent(&grants),
                args.slots
            ));
        }
    }
    for p in &problems {
        say(format!("[{name}] FAILED: {p}"));
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Runs this process's jobs at once on a supervisor over the pool; returns the grants and
/// whatever went wrong (a job that failed, a grant not released, a slot key left in etcd).
async fn run_jobs(args: &Args, endpoints: &[String], name: &str) -> (Vec<Grant>, Vec<String>) {
    let config = EtcdConfig::new(endpoints, args.pool.clone(), args.slots)
        .key_prefix(args.key_prefix.clone())
        .ttl(Duration::from_secs(args.ttl));
    let broker = match EtcdBroker::connect(config).await {
        Ok(broker) => broker,
        Err(e) => {
            return (
                vec![],
                vec![format!("cannot connect to etcd at {endpoints:?}: {e}")],
            );
        }
    };
    let prefix = broker.pool_prefix().to_owned();
    let sup = match Supervisor::builder().broker(broker).start().await {
        Ok(sup) => sup,
        Err(e) => return (vec![], vec![format!("cannot start the supervisor: {e}")]),
    };
    say(format!(
        "[{name}] pid {} on pool {prefix} ({} slots), {} jobs to run",
        std::process::id(),
        args.slots,
        args.jobs
    ));
    // The protected resource is each slot's output: one guard per slot.
    let guards: Arc<Vec<FencingGuard>> =
        Arc::new((0..args.slots).map(|_| FencingGuard::new()).collect());
    let grants = Arc::new(Mutex::new(Vec::new()));
    let runs = (1..=args.jobs).map(|n| {
        let id = format!("{name}-{n}");
        let work = Duration::from_millis(150 + u64::from(n) * 37 % 151);
        let (sup, guards, grants, name) = (
            &sup,
            Arc::clone(&guards),
            Arc::clone(&grants),
            name.to_owned(),
        );
        async move {
            let spec = JobSpec::new(id.as_str()).map_err(|e| e.to_string())?;
            let body = {
                let id = id.clone();
                move |ctx| job(ctx, name, id, work, guards, grants)
            };
            sup.run(spec, body)
                .await
                .map_err(|e| format!("job {id}: {} ({e})", e.code()))
        }
    });
    let mut problems: Vec<String> = join_all(runs)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect();
    let stats = sup.stats();
    if stats.acquired_total != stats.released_total || stats.active != 0 {
        problems.push(format!("grants not all released: {stats:?}"));
    }
    if let Err(e) = sup.shutdown().await {
        problems.push(format!("shutdown: {e}"));
    }
    let grants = grants.lock().unwrap().clone();
    // None of this process's grants may be left in etcd.
    let mine: Vec<u64> = grants.iter().map(|g| g.token).collect();
    match slot_keys(endpoints, &prefix).await {
        Ok(held) => problems.extend(
            held.into_iter()
                .filter(|(_, rev)| mine.contains(rev))
                .map(|(key, rev)| format!("{key} is still held under token {rev}")),
        ),
        Err(e) => problems.push(e),
    }
    (grants, problems)
}

/// One job: print the grant, work, pass the slot's fencing guard, "write" the output.
async fn job(
    ctx: WorkerContext,
    name: String,
    id: String,
    work: Duration,
    guards: Arc<Vec<FencingGuard>>,
    grants: Arc<Mutex<Vec<Grant>>>,
) -> Result<(), String> {
    let (token, start_us) = (ctx.token(), now_us());
    say(format!(
        "[{name}] job {id} granted slot {}, fencing token {}",
        token.slot_id(),
        token.lease_id()
    ));
    // A real body does its work next to `cancelled` the same way: the supervisor cancels a job
    // whose lease could not be kept alive.
    tokio::select! {
        () = tokio::time::sleep(work) => {}
        () = ctx.cancelled() => return Err("cancelled before its work was done".into()),
    }
    let guard = guards
        .get(token.slot_id() as usize)
        .ok_or("a slot outside the pool")?;
    // The protected side refuses a holder whose lease was lost to a newer one.
    guard.check(token).map_err(|stale| stale.to_string())?;
    grants.lock().unwrap().push(Grant {
        job: id.clone(),
        slot: token.slot_id(),
        token: token.lease_id(),
        start_us,
        end_us: now_us(),
    });
    say(format!("[{name}] job {id} done"));
    Ok(())
}

/// The default mode: a throwaway etcd, this process as `A`, a copy of it as `B`, and the
/// checks of both processes' grants.
async fn two_processes(args: &Args) -> ExitCode {
    let Some(bin) = etcd_server::find_etcd(args.etcd_bin.as_deref()) else {
        eprintln!("distributed: no etcd binary (apt-get install etcd-server, or --etcd-bin PATH)");
        return ExitCode::FAILURE;
    };
    let etcd = etcd_server::Etcd::start(&bin);
    let endpoint = etcd.endpoint();
    say(format!("throwaway etcd {} at {endpoint}", bin.display()));
    let dir = tempfile::tempdir().expect("a temp dir for the report");
    let report = dir.path().join("report-B");
    let started = Instant::now();
    let mut child = Command::new(std::env::current_exe().expect("this program's path"))
        .args(["--endpoint", &endpoint, "--name", "B", "--pool", &args.pool])
        .args([
            "--slots",
            &args.slots.to_string(),
            "--jobs",
            &args.jobs.to_string(),
        ])
        .args([
            "--ttl",
            &args.ttl.to_string(),
            "--key-prefix",
            &args.key_prefix,
        ])
        .arg("--report")
        .arg(&report)
        .spawn()
        .expect("start process B");
    let (mut grants, mut problems) = run_jobs(args, std::slice::from_ref(&endpoint), "A").await;
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap();
    if !status.as_ref().is_ok_and(|s| s.success()) {
        problems.push(format!("process B failed: {status:?}"));
    }
    let (theirs, their_problems) = read_report(&report);
    grants.extend(theirs);
    problems.extend(their_problems.into_iter().map(|p| format!("[B] {p}")));
    problems.extend(check(&grants, args.slots));
    if grants.len() != 2 * args.jobs as usize {
        problems.push(format!(
            "{} grants for {} jobs",
            grants.len(),
            2 * args.jobs
        ));
    }
    let prefix = format!("{}/{}/", args.key_prefix, args.pool);
    match slot_keys(std::slice::from_ref(&endpoint), &prefix).await {
        Ok(held) if held.is_empty() => {}
        Ok(held) => problems.push(format!("slot keys left in etcd: {held:?}")),
        Err(e) => problems.push(e),
    }
    println!();
    let mut by_slot: BTreeMap<u32, Vec<&Grant>> = BTreeMap::new();
    for g in &grants {
        by_slot.entry(g.slot).or_default().push(g);
    }
    for (slot, list) in &mut by_slot {
        list.sort_by_key(|g| g.start_us);
        let tokens: Vec<String> = list
            .iter()
            .map(|g| format!("{}:{}", g.job, g.token))
            .collect();
        println!("slot {slot}: {}", tokens.join(" → "));
    }
    println!(
        "{} grants in {:.1} s, at most {} of {} slots held at once, {}",
        grants.len(),
        started.elapsed().as_secs_f64(),
        max_concurrent(&grants),
        args.slots,
        if problems.is_empty() {
            "every check passed"
        } else {
            "FAILED"
        }
    );
    for p in &problems {
        println!("FAILED: {p}");
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Process B's grants and problems, from its report file.
fn read_report(path: &Path) -> (Vec<Grant>, Vec<String>) {
    let Ok(text) = std::fs::read_to_string(path) else {
        return (vec![], vec![format!("no report at {}", path.display())]);
    };
    let (mut grants, mut problems) = (vec![], vec![]);
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["grant", job, slot, token, start, end] => grants.push(Grant {
                job: (*job).to_owned(),
                slot: slot.parse().unwrap_or(u32::MAX),
                token: token.parse().unwrap_or(0),
                start_us: start.parse().unwrap_or(0),
                end_us: end.parse().unwrap_or(0),
            }),
            _ => problems.push(line.trim_start_matches("problem ").to_owned()),
        }
    }
    (grants, problems)
}

/// Tokens strictly increase in grant order on every slot, and never more slots are held at once
/// than the pool has.
fn check(grants: &[Grant], slots: u32) -> Vec<String> {
    let mut problems = Vec::new();
    let mut by_slot: BTreeMap<u32, Vec<&Grant>> = BTreeMap::new();
    for g in grants {
        by_slot.entry(g.slot).or_default().push(g);
    }
    for (slot, list) in &mut by_slot {
        list.sort_by_key(|g| g.start_us);
        for w in list.windows(2) {
            if w[1].token <= w[0].token {
                problems.push(format!(
                    "slot {slot}: token {} after {}",
                    w[1].token, w[0].token
                ));
            }
            if w[1].start_us < w[0].end_us {
                problems.push(format!(
                    "slot {slot}: {} and {} overlap",
                    w[0].job, w[1].job
                ));
            }
        }
    }
    if max_concurrent(grants) > slots as usize {
        problems.push(format!("{} slots held at once", max_concurrent(grants)));
    }
    problems
}

fn max_concurrent(grants: &[Grant]) -> usize {
    let mut edges: Vec<(u64, i64)> = grants
        .iter()
        .flat_map(|g| [(g.start_us, 1), (g.end_us, -1)])
        .collect();
    edges.sort_unstable(); // at equal times, an end (-1) before a start (+1)
    let (mut now, mut max) = (0i64, 0i64);
    for (_, d) in edges {
        now += d;
        max = max.max(now);
    }
    max as usize
}

/// The pool's slot keys with their grant revisions (the tokens they carry), read from etcd.
async fn slot_keys(endpoints: &[String], prefix: &str) -> Result<Vec<(String, u64)>, String> {
    let read = async {
        let mut c = etcd_client::Client::connect(endpoints, None).await?;
        c.get(
            format!("{prefix}slot/"),
            Some(GetOptions::new().with_prefix()),
        )
        .await
    };
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Ok(Ok(resp)) => Ok(resp
            .kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key_str().unwrap_or("?").to_owned(),
                    kv.mod_revision() as u64,
                )
            })
            .collect()),
        Ok(Err(e)) => Err(format!("cannot read the slot keys: {e}")),
        Err(_) => Err("cannot read the slot keys: no answer within 5 s".into()),
    }
}

fn say(line: String) {
    println!("{line}");
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}
