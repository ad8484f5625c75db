//! etcd (feature `etcd`, required by this bench): `EtcdBroker` acquire + release, driven
//! directly and through a supervisor (uncontended, 8 slots), against one bare etcd put, all on a
//! single-member etcd on loopback that the bench starts (data dir on the scratch file system,
//! tmpfs when there is one). The etcd binary is `$LEASEHOLD_ETCD_BIN` or `etcd` on `PATH`;
//! without one it prints a loud skip line and measures nothing; with `LEASEHOLD_REQUIRE_ETCD=1`
//! (CI) a missing binary is a panic.
//!
//! criterion ids are `etcd/<bare_put|etcd_broker|leasehold>/slots=8`. The last "benchmark",
//! `summary`, prints the ratio rows from the samples criterion took above. `-- --test` runs each
//! once.

mod floor;

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use leasehold::{AcquireRequest, EtcdBroker, EtcdConfig, Lease, SlotBroker, Supervisor};
use tokio::runtime::Runtime;

use floor::{key, ratio_row, runtime, table_end, table_start, timed};

const ETCD: &str = "etcd";
const ETCD_BARE_PUT: &str = "bare_put";
const ETCD_BROKER: &str = "etcd_broker";
const ETCD_SUPERVISOR: &str = "leasehold";
/// The pool's capacity; every figure is uncontended (one acquire at a time).
const ETCD_SLOTS: u32 = 8;
const ETCD_SAMPLES: usize = 20;
/// The floor's key and value (the value about as long as a leasehold slot record), outside
/// the pool's prefix.
const FLOOR_KEY: &str = "bench-floor/put";
const FLOOR_VALUE: &str = "leasehold/v1 holder lease=0123456789abcdef";
/// Set to `1` (CI does) to make a missing etcd binary a failure instead of a skip.
const REQUIRE_ETCD_ENV: &str = "LEASEHOLD_REQUIRE_ETCD";
/// How long etcd gets to answer `/health` with `"health":"true"`.
const HEALTH_LIMIT: Duration = Duration::from_secs(30);
/// Fresh port pairs tried when etcd exits early (a port taken between probe and bind).
const START_ATTEMPTS: usize = 5;

/// `$LEASEHOLD_ETCD_BIN`, else `etcd` on `PATH`; `None` (after a loud skip line) when there
/// is none, a panic when CI requires one.
fn etcd_binary() -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = match std::env::var_os("LEASEHOLD_ETCD_BIN").filter(|b| !b.is_empty()) {
        Some(bin) => Some(PathBuf::from(bin)).filter(|b| executable(b)),
        None => std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("etcd"))
                .find(|c| executable(c))
        }),
    };
    if found.is_none() {
        if std::env::var(REQUIRE_ETCD_ENV).as_deref() == Ok("1") {
            panic!(
                "{REQUIRE_ETCD_ENV}=1 but no etcd binary was found (apt-get install etcd-server)"
            );
        }
        eprintln!(
            "\n*** SKIPPED etcd benchmarks: no etcd binary (apt-get install etcd-server) ***\n"
        );
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// `GET /health` over plain HTTP/1.1: whether etcd says it is healthy.
fn healthy(port: u16) -> bool {
    let ask = || -> io::Result<String> {
        let timeout = Duration::from_millis(500);
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        write!(
            stream,
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    };
    ask().is_ok_and(|r| r.contains("\"health\":\"true\""))
}

/// One single-member etcd on free loopback ports, its data dir on the scratch file system
/// (tmpfs when there is one, as for the job temp dirs: the figures are round trips and
/// etcd's own work, not the disk's fsync); killed and reaped on drop.
struct EtcdServer {
    child: Child,
    endpoint: String,
    dir: tempfile::TempDir,
}

impl EtcdServer {
    fn start(bin: &Path) -> Self {
        let mut last = String::new();
        for _ in 0..START_ATTEMPTS {
            let dir = etcd_scratch_dir();
            let (client, peer) = (free_port(), free_port());
            if client == peer {
                continue;
            }
            let log = File::create(dir.path().join("etcd.log")).expect("etcd log file");
            let log_err = log.try_clone().expect("etcd log file");
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let child = Command::new(bin)
                .arg("--name")
                .arg("b")
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .arg("--listen-client-urls")
                .arg(&endpoint)
                .arg("--advertise-client-urls")
                .arg(&endpoint)
                .arg("--listen-peer-urls")
                .arg(&peer_url)
                .arg("--initial-advertise-peer-urls")
                .arg(&peer_url)
                .arg("--initial-cluster")
                .arg(format!("b={peer_url}"))
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err)
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
            let mut server = Self {
                child,
                endpoint,
                dir,
            };
            let deadline = Instant::now() + HEALTH_LIMIT;
            loop {
                if let Ok(Some(status)) = server.child.try_wait() {
                    last = format!("etcd exited early ({status}):\n{}", server.log_tail());
                    break;
                }
                if healthy(client) {
                    return server;
                }
                assert!(
                    Instant::now() < deadline,
                    "etcd not healthy within {HEALTH_LIMIT:?} on {}:\n{}",
                    server.endpoint,
                    server.log_tail()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("etcd did not start in {START_ATTEMPTS} attempts; last: {last}");
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The data dir's parent: `LEASEHOLD_BENCH_ROOT`, else `/dev/shm`, else the temp dir.
fn etcd_scratch_dir() -> tempfile::TempDir {
    std::env::var_os("LEASEHOLD_BENCH_ROOT")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("/dev/shm"), std::env::temp_dir()])
        .find_map(|base| {
            tempfile::Builder::new()
                .prefix("leasehold-bench-etcd-")
                .tempdir_in(base)
                .ok()
        })
        .expect("a writable scratch dir for etcd")
}

/// What the group measures against: started on the first benchmark that runs, so that a
/// filter that skips the whole group starts no etcd.
struct EtcdBench {
    client: etcd_client::Client,
    broker: Arc<EtcdBroker>,
    next_request: Arc<AtomicU64>,
    sup: Supervisor,
    server: EtcdServer,
}

fn start_bench(rt: &Runtime, bin: &Path) -> EtcdBench {
    let server = EtcdServer::start(bin);
    let endpoint = server.endpoint.clone();
    println!(
        "etcd benchmarks on {} at {endpoint}, data dir under {}",
        bin.display(),
        server.dir.path().display()
    );
    let (client, broker, sup) = rt.block_on(async {
        let client = etcd_client::Client::connect([endpoint.as_str()], None)
            .await
            .expect("etcd client connects");
        let config = EtcdConfig::new([endpoint.as_str()], "bench", ETCD_SLOTS);
        // Two brokers on the same pool: one driven directly, one owned by the supervisor.
        let broker = EtcdBroker::connect(config.clone())
            .await
            .expect("broker connects");
        let sup_broker = EtcdBroker::connect(config).await.expect("broker connects");
        let sup = Supervisor::builder()
            .broker(sup_broker)
            .start()
            .await
            .expect("supervisor starts");
        (client, Arc::new(broker), sup)
    });
    EtcdBench {
        client,
        broker,
        next_request: Arc::new(AtomicU64::new(1)),
        sup,
        server,
    }
}

/// A bare etcd put against `EtcdBroker` acquire + release (direct and through a supervisor),
/// all on one loopback etcd. One broker acquire is a lease grant and two transactions (join
/// the queue and read the pool, claim a slot and read the pool); its release is one revoke.
fn etcd(c: &mut Criterion) {
    let Some(bin) = etcd_binary() else {
        return;
    };
    let rt = runtime();
    let mut bench: Option<EtcdBench> = None;

    let mut group = c.benchmark_group(ETCD);
    group
        .sample_size(ETCD_SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    let p = format!("slots={ETCD_SLOTS}");

    let k = key(ETCD, ETCD_BARE_PUT, &p);
    group.bench_function(BenchmarkId::new(ETCD_BARE_PUT, &p), |b| {
        let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
        timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
            let mut client = s.client.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    client
                        .put(FLOOR_KEY, FLOOR_VALUE, None)
                        .await
                        .expect("etcd put");
                }
                start.elapsed()
            }
        });
    });

    let k = key(ETCD, ETCD_BROKER, &p);
    group.bench_function(BenchmarkId::new(ETCD_BROKER, &p), |b| {
        let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
        timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
            let (broker, next) = (Arc::clone(&s.broker), Arc::clone(&s.next_request));
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let id = next.fetch_add(1, Ordering::Relaxed);
                    let token = broker
                        .acquire(AcquireRequest::new(id, None))
                        .await
                        .expect("broker acquire");
                    broker.release(token).await.expect("broker release");
                }
                start.elapsed()
            }
        });
    });

    let k = key(ETCD, ETCD_SUPERVISOR, &p);
    group.bench_function(BenchmarkId::new(ETCD_SUPERVISOR, &p), |b| {
        let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
        timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
            let sup = s.sup.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let mut lease: Lease = sup.acquire().await.expect("acquire");
                    lease.release().await.expect("release");
                }
                start.elapsed()
            }
        });
    });
    group.finish();

    if let Some(EtcdBench {
        client,
        broker,
        sup,
        server,
        ..
    }) = bench
    {
        rt.block_on(sup.shutdown()).expect("shutdown");
        drop((client, broker, sup));
        // The runtime (and every etcd client task on it) goes before the server does.
        drop(rt);
        drop(server);
    }
}

// ---------------------------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------------------------

/// Uncontended acquire + release in at most two consensus writes: ≤ 2.5× one bare put (issue 12).
const TARGET_BARE_PUT: f64 = 2.5;

/// The etcd rows: `EtcdBroker` acquire + release, alone and through a supervisor, over one bare
/// etcd put on the same loopback server.
fn summary(_c: &mut Criterion) {
    if !table_start("etcd", "per acquire + release, or per put") {
        return;
    }
    let k = |f: &str| key(ETCD, f, &format!("slots={ETCD_SLOTS}"));
    ratio_row(
        "etcd acquire+release (broker) / bare etcd put",
        &k(ETCD_BROKER),
        &k(ETCD_BARE_PUT),
        1,
        Some(TARGET_BARE_PUT),
    );
    ratio_row(
        "etcd acquire+release (supervisor) / bare etcd put",
        &k(ETCD_SUPERVISOR),
        &k(ETCD_BARE_PUT),
        1,
        None,
    );
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = etcd, summary
}
criterion_main!(benches);
