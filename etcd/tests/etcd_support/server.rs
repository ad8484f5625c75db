//! A throwaway etcd on loopback: one member (`Etcd`, `EtcdWith` for TLS and extra flags) or a
//! cluster of several (`Cluster`), each on free ports with throwaway data dirs, killed, reaped
//! and removed on drop; and reading a member's `/health` and `/metrics`.
//!
//! Shared by the etcd tests (`mod etcd_support`), `examples/distributed.rs`, `benches/etcd.rs`
//! and `benches/etcd_scale.rs` (each includes this file with `#[path]`), so it depends on std and
//! `tempfile` only.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use tempfile::TempDir;
// ---------------------------------------------------------------------------------------------
// Finding the binary
// ---------------------------------------------------------------------------------------------

/// Finds the etcd binary: `$LEASEHOLD_ETCD_BIN` if set, else `etcd` on `PATH`.
///
/// When none is found, panics if `LEASEHOLD_REQUIRE_ETCD=1`, otherwise prints a loud `SKIPPED`
/// line naming `test` to stderr and returns `None` (the caller returns early).
pub fn etcd_binary(test: &str) -> Option<PathBuf> {
    let found = match std::env::var_os("LEASEHOLD_ETCD_BIN") {
        Some(bin) if !bin.is_empty() => {
            let bin = PathBuf::from(bin);
            if is_executable(&bin) {
                Some(bin)
            } else {
                eprintln!(
                    "LEASEHOLD_ETCD_BIN={} is not an executable file",
                    bin.display()
                );
                None
            }
        }
        _ => std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("etcd"))
                .find(|candidate| is_executable(candidate))
        }),
    };
    if found.is_none() {
        if std::env::var("LEASEHOLD_REQUIRE_ETCD").as_deref() == Ok("1") {
            panic!(
                "LEASEHOLD_REQUIRE_ETCD=1 but no etcd binary found: apt-get install etcd-server"
            );
        }
        eprintln!(
            "SKIPPED {test}: no etcd binary (install etcd-server, or set LEASEHOLD_ETCD_BIN); \
             set LEASEHOLD_REQUIRE_ETCD=1 to fail instead"
        );
    }
    found
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// A free loopback port: binds `127.0.0.1:0`, reads the port and closes the listener (racy by
/// nature; callers retry).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A plain HTTP/1.1 `GET path` to `127.0.0.1:port` on a fresh connection, with `timeout` for the
/// connect and for each read/write; returns the whole response (status line, headers, body) as
/// text once the server closes the connection.
pub fn http_get(port: u16, path: &str, timeout: Duration) -> io::Result<String> {
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

/// Whether an `http_get` response is etcd's `/health` answer saying it is healthy.
pub fn is_healthy_response(response: &str) -> bool {
    response.starts_with("HTTP/1.1 200") && response.contains("\"health\":\"true\"")
}

// ---------------------------------------------------------------------------------------------
// Etcd
// ---------------------------------------------------------------------------------------------

/// How long `start`/`restart` wait for `/health` to say true.
const HEALTH_LIMIT: Duration = Duration::from_secs(30);
/// How many times `start` retries with fresh ports when etcd exits early (a port race).
const START_ATTEMPTS: usize = 5;
/// How long `restart` keeps respawning on the same ports when etcd exits early.
const RESTART_LIMIT: Duration = Duration::from_secs(10);

/// One etcd server on free loopback ports with a throwaway data dir; killed, reaped and removed
/// on drop. Its stdout/stderr go to a log file in a separate temp dir (see `log_tail`).
pub struct Etcd {
    bin: PathBuf,
    data: TempDir,
    logs: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    pid: u32,
}

/// Why waiting for health failed.
enum WaitError {
    /// The process exited before it became healthy (e.g. a port was taken).
    Exited(String),
    /// Still running but not healthy within the limit.
    TimedOut,
}

impl Etcd {
    /// Starts a single-member etcd on two free loopback ports with a fresh data dir and waits until
    /// `/health` says true (retrying with new ports up to 5 times if it exits early; panics with
    /// the log tail if it never becomes healthy).
    pub fn start(bin: &Path) -> Etcd {
        Etcd::start_in(bin, None)
    }

    /// [`start`](Self::start), with the data dir under `base` (e.g. `/dev/shm`).
    pub fn start_in(bin: &Path, base: Option<&Path>) -> Etcd {
        let mut etcd = Etcd {
            bin: bin.to_path_buf(),
            data: data_dir_in(base),
            logs: tempfile::Builder::new()
                .prefix("leasehold-etcd-log-")
                .tempdir()
                .expect("create etcd log dir"),
            client_port: 0,
            peer_port: 0,
            child: None,
            pid: 0,
        };
        let mut last_error = String::new();
        for attempt in 1..=START_ATTEMPTS {
            if attempt > 1 {
                // A fresh data dir: the failed attempt may have left a half-initialised member.
                etcd.data = data_dir_in(base);
            }
            etcd.client_port = free_port();
            etcd.peer_port = free_port();
            while etcd.peer_port == etcd.client_port {
                etcd.peer_port = free_port();
            }
            etcd.spawn();
            match etcd.wait_healthy(HEALTH_LIMIT) {
                Ok(()) => return etcd,
                Err(WaitError::Exited(status)) => {
                    last_error = format!(
                        "attempt {attempt}: etcd exited early ({status}) on client port {}, \
                         peer port {}",
                        etcd.client_port, etcd.peer_port
                    );
                    eprintln!("{last_error}; retrying");
                }
                Err(WaitError::TimedOut) => panic!(
                    "etcd did not become healthy within {HEALTH_LIMIT:?} on {}; log tail:\n{}",
                    etcd.endpoint(),
                    etcd.log_tail()
                ),
            }
        }
        panic!(
            "etcd failed to start {START_ATTEMPTS} times; last: {last_error}; log tail:\n{}",
            etcd.log_tail()
        );
    }

    /// The client URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The peer port.
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// The process id of the current (or, after `kill9`, the last) etcd process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether an etcd process is running (spawned and not yet reaped).
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The data dir (kept across `kill9`/`restart`, removed on drop).
    pub fn data_dir(&self) -> PathBuf {
        self.data.path().join("data")
    }

    /// The last ~40 lines of etcd's combined stdout/stderr (all runs, including restarts).
    pub fn log_tail(&self) -> String {
        tail_of(&self.log_path(), 40)
    }

    /// Sends SIGKILL to etcd and reaps it (no-op when it is not running).
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // `Child::kill` is SIGKILL on unix; it fails only if the child was already reaped.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports and the same data dir (killing a running one first),
    /// respawning for up to 10 s if it exits early (ports briefly in use), then waits for health.
    pub fn restart(&mut self) {
        self.kill9();
        let deadline = Instant::now() + RESTART_LIMIT;
        loop {
            self.spawn();
            match self.wait_healthy(HEALTH_LIMIT) {
                Ok(()) => return,
                Err(WaitError::Exited(status)) if Instant::now() < deadline => {
                    eprintln!(
                        "etcd restart on {} exited early ({status}); retrying",
                        self.endpoint()
                    );
                    thread::sleep(Duration::from_millis(100));
                }
                Err(WaitError::Exited(status)) => panic!(
                    "etcd restart on {} kept exiting early for {RESTART_LIMIT:?} (last: {status}); \
                     log tail:\n{}",
                    self.endpoint(),
                    self.log_tail()
                ),
                Err(WaitError::TimedOut) => panic!(
                    "restarted etcd did not become healthy within {HEALTH_LIMIT:?} on {}; \
                     log tail:\n{}",
                    self.endpoint(),
                    self.log_tail()
                ),
            }
        }
    }

    /// Whether `/health` answers true right now (one request, 1 s timeout).
    pub fn healthy(&self) -> bool {
        http_get(self.client_port, "/health", Duration::from_secs(1))
            .map(|r| is_healthy_response(&r))
            .unwrap_or(false)
    }

    fn log_path(&self) -> PathBuf {
        self.logs.path().join("etcd.log")
    }

    fn spawn(&mut self) {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open etcd log file");
        let log_err = log.try_clone().expect("clone etcd log file");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = etcd_command(&self.bin, &self.data_dir(), &client, &peer)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        self.pid = child.id();
        self.child = Some(child);
    }

    fn wait_healthy(&mut self, limit: Duration) -> Result<(), WaitError> {
        let deadline = Instant::now() + limit;
        let mut backoff = Duration::from_millis(10);
        loop {
            if let Some(child) = &mut self.child {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(WaitError::Exited(status.to_string()));
                }
            } else {
                return Err(WaitError::Exited("not running".into()));
            }
            if self.healthy() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(WaitError::TimedOut);
            }
            thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill9();
        // The TempDirs (data and log) are removed by their own Drop after this.
    }
}

/// The last `n` lines of a text file (an explanatory line if it cannot be read).
fn tail_of(path: &Path, n: usize) -> String {
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
// Etcd with extra flags (TLS)
// ---------------------------------------------------------------------------------------------

/// What etcd (3.4/3.5, zap logger) logs when it starts serving clients over TLS. It serves
/// clients only once its member is ready (has a leader and has published itself to the cluster),
/// so this line means the server answers requests.
pub const SERVING_SECURELY: &str = "serving client traffic securely";

/// One etcd server started by [`Etcd::start_with`]: client URLs of a chosen scheme and extra
/// command-line flags (e.g. `--cert-file`, `--key-file`, `--trusted-ca-file`,
/// `--client-cert-auth`). Killed, reaped and removed on drop, like [`Etcd`].
pub struct EtcdWith {
    etcd: Etcd,
    scheme: String,
    extra_args: Vec<String>,
}

impl Etcd {
    /// Like [`Etcd::start`], but the client URLs use `scheme` (`"http"` or `"https"`) and
    /// `extra_args` are appended to etcd's command line (peers stay on plain http).
    ///
    /// Readiness: with `"http"`, `/health` says true (as for `start`); with `"https"` (where a
    /// plain HTTP GET cannot be used), etcd's log of this run says [`SERVING_SECURELY`] and the
    /// client port accepts a TCP connection. Retries with fresh ports up to 5 times if etcd exits
    /// early; panics with the log tail if it never becomes ready.
    pub fn start_with(bin: &Path, scheme: &str, extra_args: &[String]) -> EtcdWith {
        assert!(
            matches!(scheme, "http" | "https"),
            "scheme must be \"http\" or \"https\", not {scheme:?}"
        );
        let mut server = EtcdWith {
            etcd: Etcd {
                bin: bin.to_path_buf(),
                data: data_dir_in(None),
                logs: tempfile::Builder::new()
                    .prefix("leasehold-etcd-log-")
                    .tempdir()
                    .expect("create etcd log dir"),
                client_port: 0,
                peer_port: 0,
                child: None,
                pid: 0,
            },
            scheme: scheme.to_owned(),
            extra_args: extra_args.to_vec(),
        };
        let mut last_error = String::new();
        for attempt in 1..=START_ATTEMPTS {
            if attempt > 1 {
                server.etcd.data = data_dir_in(None);
            }
            server.etcd.client_port = free_port();
            server.etcd.peer_port = free_port();
            while server.etcd.peer_port == server.etcd.client_port {
                server.etcd.peer_port = free_port();
            }
            let log_from = server.spawn();
            match server.wait_ready(HEALTH_LIMIT, log_from) {
                Ok(()) => return server,
                Err(WaitError::Exited(status)) => {
                    last_error = format!(
                        "attempt {attempt}: etcd exited early ({status}) on client port {}, \
                         peer port {}",
                        server.etcd.client_port, server.etcd.peer_port
                    );
                    eprintln!("{last_error}; retrying");
                }
                Err(WaitError::TimedOut) => panic!(
                    "etcd did not become ready within {HEALTH_LIMIT:?} on {}; log tail:\n{}",
                    server.endpoint(),
                    server.log_tail()
                ),
            }
        }
        panic!(
            "etcd failed to start {START_ATTEMPTS} times; last: {last_error}; log tail:\n{}",
            server.log_tail()
        );
    }
}

impl EtcdWith {
    /// The client URL, `{scheme}://127.0.0.1:PORT` (e.g. `https://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.etcd.client_port)
    }

    /// The client URLs' scheme, `http` or `https`.
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.etcd.client_port
    }

    /// The peer port.
    pub fn peer_port(&self) -> u16 {
        self.etcd.peer_port
    }

    /// The process id of the current (or, after `kill9`, the last) etcd process.
    pub fn pid(&self) -> u32 {
        self.etcd.pid
    }

    /// Whether an etcd process is running (spawned and not yet reaped).
    pub fn is_running(&mut self) -> bool {
        self.etcd.is_running()
    }

    /// The data dir (removed on drop).
    pub fn data_dir(&self) -> PathBuf {
        self.etcd.data_dir()
    }

    /// The last ~40 lines of etcd's combined stdout/stderr (all attempts).
    pub fn log_tail(&self) -> String {
        self.etcd.log_tail()
    }

    /// The whole of etcd's combined stdout/stderr so far (all attempts).
    pub fn log(&self) -> String {
        let path = self.etcd.log_path();
        fs::read(&path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()))
    }

    /// Sends SIGKILL to etcd and reaps it (no-op when it is not running).
    pub fn kill9(&mut self) {
        self.etcd.kill9();
    }

    /// Spawns etcd on the current ports with the extra flags; returns the log's length before
    /// the spawn (where this run's lines begin).
    fn spawn(&mut self) -> u64 {
        let log_path = self.etcd.log_path();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open etcd log file");
        let log_from = log.metadata().map(|m| m.len()).unwrap_or(0);
        let log_err = log.try_clone().expect("clone etcd log file");
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.etcd.peer_port);
        let child = etcd_command(&self.etcd.bin, &self.etcd.data_dir(), &client, &peer)
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.etcd.bin.display()));
        self.etcd.pid = child.id();
        self.etcd.child = Some(child);
        log_from
    }

    /// Whether etcd serves clients now: `/health` for http; for https, this run's log says
    /// [`SERVING_SECURELY`] and the client port accepts a TCP connection.
    fn ready(&self, log_from: u64) -> bool {
        if self.scheme == "http" {
            return self.etcd.healthy();
        }
        let logged = fs::read(self.etcd.log_path())
            .ok()
            .and_then(|bytes| {
                let from = usize::try_from(log_from).ok()?;
                bytes
                    .get(from..)
                    .map(|run| String::from_utf8_lossy(run).contains(SERVING_SECURELY))
            })
            .unwrap_or(false);
        logged
            && TcpStream::connect_timeout(
                &SocketAddr::from(([127, 0, 0, 1], self.etcd.client_port)),
                Duration::from_secs(1),
            )
            .is_ok()
    }

    fn wait_ready(&mut self, limit: Duration, log_from: u64) -> Result<(), WaitError> {
        let deadline = Instant::now() + limit;
        let mut backoff = Duration::from_millis(10);
        loop {
            if let Some(child) = &mut self.etcd.child {
                if let Ok(Some(status)) = child.try_wait() {
                    self.etcd.child = None;
                    return Err(WaitError::Exited(status.to_string()));
                }
            } else {
                return Err(WaitError::Exited("not running".into()));
            }
            if self.ready(log_from) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(WaitError::TimedOut);
            }
            thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }
}

/// A one-member etcd on `client` (its URL: scheme, loopback, port) and `peer`, logging to
/// stderr.
fn etcd_command(bin: &Path, data_dir: &Path, client: &str, peer: &str) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("--name")
        .arg("t")
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--listen-client-urls")
        .arg(client)
        .arg("--advertise-client-urls")
        .arg(client)
        .arg("--listen-peer-urls")
        .arg(peer)
        .arg("--initial-advertise-peer-urls")
        .arg(peer)
        .arg("--initial-cluster")
        .arg(format!("t={peer}"))
        .arg("--logger")
        .arg("zap")
        .arg("--log-outputs")
        .arg("stderr");
    cmd
}

/// Where a benchmark puts etcd's data dirs: `$LEASEHOLD_BENCH_ROOT`, else `/dev/shm` (tmpfs, so
/// that the figures are round trips and etcd's work, not a disk's fsync); `None` (the OS temp
/// dir) when that is not a directory.
pub fn bench_data_base() -> Option<PathBuf> {
    std::env::var_os("LEASEHOLD_BENCH_ROOT")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from("/dev/shm")))
        .filter(|p| p.is_dir())
}

/// The etcd binary: `explicit` if given, else `$LEASEHOLD_ETCD_BIN`, else `etcd` on `PATH`;
/// `None` when none of them is an executable file.
pub fn find_etcd(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(bin) = explicit {
        return is_executable(bin).then(|| bin.to_path_buf());
    }
    if let Some(bin) = std::env::var_os("LEASEHOLD_ETCD_BIN").filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        return is_executable(&bin).then_some(bin);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("etcd"))
            .find(|candidate| is_executable(candidate))
    })
}

// ---------------------------------------------------------------------------------------------
// Cluster
// ---------------------------------------------------------------------------------------------

/// One member of a [`Cluster`].
struct ClusterMember {
    name: String,
    data: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// An etcd cluster of several members on loopback, each on free ports with a throwaway data dir
/// (under `base` when given, e.g. `/dev/shm`), and one log file for all. Killed, reaped and
/// removed on drop.
pub struct Cluster {
    bin: PathBuf,
    members: Vec<ClusterMember>,
    logs: TempDir,
    token: String,
    /// Members serve their profiles (`--enable-pprof`).
    pprof: bool,
}

impl Cluster {
    /// Starts an `n`-member cluster and waits until every member says it is healthy (which
    /// needs a leader). Retries with fresh ports when a member exits early (a port race); panics
    /// with the log tail if the cluster never becomes healthy.
    pub fn start(bin: &Path, n: usize) -> Cluster {
        Cluster::start_in(bin, n, None)
    }

    /// [`start`](Self::start), with the data dirs under `base`; with `--enable-pprof` when
    /// `LEASEHOLD_ETCD_PPROF` is set.
    pub fn start_in(bin: &Path, n: usize, base: Option<&Path>) -> Cluster {
        let pprof = std::env::var_os("LEASEHOLD_ETCD_PPROF").is_some();
        Cluster::start_with(bin, n, base, pprof)
    }

    /// [`start_in`](Self::start_in); `pprof`: every member serves its profiles
    /// (`--enable-pprof`: `/debug/pprof/` on its client port).
    pub fn start_with(bin: &Path, n: usize, base: Option<&Path>, pprof: bool) -> Cluster {
        assert!(n >= 1, "a cluster needs a member");
        let mut last = String::new();
        for attempt in 1..=START_ATTEMPTS {
            let mut ports = Vec::new();
            while ports.len() < 2 * n {
                let p = free_port();
                if !ports.contains(&p) {
                    ports.push(p);
                }
            }
            let mut cluster = Cluster {
                bin: bin.to_path_buf(),
                members: (0..n)
                    .map(|i| ClusterMember {
                        name: format!("m{i}"),
                        data: data_dir_in(base),
                        client_port: ports[2 * i],
                        peer_port: ports[2 * i + 1],
                        child: None,
                    })
                    .collect(),
                logs: tempfile::Builder::new()
                    .prefix("leasehold-etcd-log-")
                    .tempdir()
                    .expect("create etcd log dir"),
                token: format!("leasehold-{}-{attempt}", std::process::id()),
                pprof,
            };
            for i in 0..n {
                cluster.spawn(i, "new");
            }
            match cluster.wait_all_healthy(HEALTH_LIMIT) {
                Ok(()) => return cluster,
                Err(why) => {
                    last = format!("attempt {attempt}: {why}");
                    eprintln!("{last}; retrying with fresh ports");
                }
            }
        }
        panic!("etcd cluster failed to start {START_ATTEMPTS} times; last: {last}");
    }

    /// How many members the cluster has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Member `i`'s client URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Member `i`'s client port.
    pub fn client_port(&self, i: usize) -> u16 {
        self.members[i].client_port
    }

    /// Member `i`'s process id, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// Whether member `i`'s process runs.
    pub fn is_running(&mut self, i: usize) -> bool {
        match &mut self.members[i].child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Sends SIGKILL to member `i` and reaps it (no-op when it is not running).
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its ports and data dir (killing it first if it runs). Does
    /// not wait for health: a member alone cannot be healthy without a quorum.
    pub fn restart(&mut self, i: usize) {
        self.kill9(i);
        self.spawn(i, "existing");
    }

    /// Whether member `i`'s `/health` says true now (it has a leader).
    pub fn healthy(&self, i: usize) -> bool {
        http_get(
            self.members[i].client_port,
            "/health",
            Duration::from_secs(1),
        )
        .map(|r| is_healthy_response(&r))
        .unwrap_or(false)
    }

    /// Waits until every running member is healthy, or panics after `limit` with the log tail.
    pub fn wait_healthy(&mut self, limit: Duration) {
        if let Err(why) = self.wait_all_healthy(limit) {
            panic!("{why}");
        }
    }

    /// Member `i`'s `/metrics` text.
    pub fn metrics(&self, i: usize) -> io::Result<String> {
        http_get(
            self.members[i].client_port,
            "/metrics",
            Duration::from_secs(2),
        )
    }

    /// The member that says it is the leader (from `/metrics`), if one does.
    pub fn leader(&self) -> Option<usize> {
        (0..self.len()).find(|i| {
            self.metrics(*i)
                .map(|m| metric_sum(&m, "etcd_server_is_leader") == 1.0)
                .unwrap_or(false)
        })
    }

    /// Waits (polling `/metrics`) until a running member says it is the leader.
    pub fn wait_leader(&mut self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(i) = self.leader()
                && self.is_running(i)
            {
                return i;
            }
            assert!(
                Instant::now() < deadline,
                "no leader within {limit:?}; log tail:\n{}",
                self.log_tail()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last ~60 lines of every member's combined stdout/stderr.
    pub fn log_tail(&self) -> String {
        tail_of(&self.logs.path().join("etcd.log"), 60)
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.path().join("etcd.log"))
            .expect("open etcd log file");
        let log_err = log.try_clone().expect("clone etcd log file");
        let initial = self.initial_cluster();
        let m = &mut self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new(&self.bin)
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(m.data.path().join("data"))
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(&initial)
            .arg("--initial-cluster-state")
            .arg(state)
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .arg("--logger")
            .arg("zap")
            .arg("--log-outputs")
            .arg("stderr")
            // For profiling a benchmark's members (`/debug/pprof/` on the client port).
            .args(self.pprof.then_some("--enable-pprof"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        m.child = Some(child);
    }

    fn wait_all_healthy(&mut self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        loop {
            let mut all = true;
            for i in 0..self.len() {
                let Some(child) = &mut self.members[i].child else {
                    continue; // killed on purpose
                };
                if let Ok(Some(status)) = child.try_wait() {
                    self.members[i].child = None;
                    return Err(format!(
                        "member {i} exited early ({status}); log tail:\n{}",
                        self.log_tail()
                    ));
                }
                all &= self.healthy(i);
            }
            if all {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "cluster not healthy within {limit:?}; log tail:\n{}",
                    self.log_tail()
                ));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.len() {
            self.kill9(i);
        }
    }
}

fn data_dir_in(base: Option<&Path>) -> TempDir {
    let builder = {
        let mut b = tempfile::Builder::new();
        b.prefix("leasehold-etcd-data-");
        b
    };
    match base {
        Some(base) => builder.tempdir_in(base),
        None => builder.tempdir(),
    }
    .expect("create etcd data dir")
}

/// The sum of every sample of metric `name` (any labels) in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
