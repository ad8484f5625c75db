//! Test support for the etcd integration tests: a throwaway etcd server, a fault-injecting TCP
//! proxy (lost answers, black hole) and an independent, cross-process record of slot occupancy.
//!
//! Everything here is built on std (threads, `std::net`, `std::process`) so it works from any
//! test, synchronous or inside any async runtime.
#![allow(dead_code, unreachable_pub)]

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
        let mut etcd = Etcd {
            bin: bin.to_path_buf(),
            data: new_data_dir(),
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
                etcd.data = new_data_dir();
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

fn new_data_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("leasehold-etcd-data-")
        .tempdir()
        .expect("create etcd data dir")
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
// Proxy
// ---------------------------------------------------------------------------------------------

const MODE_FORWARD: u8 = 0;
const MODE_DROP_RESPONSES: u8 = 1;
const MODE_BLACKHOLE: u8 = 2;

/// Which way a pump moves bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ClientToServer,
    ServerToClient,
}

/// One proxied connection: clones of both sockets, so `heal`/drop can shut them down.
struct Conn {
    id: u64,
    generation: u64,
    client: TcpStream,
    server: TcpStream,
}

impl Conn {
    fn close(&self) {
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.server.shutdown(Shutdown::Both);
    }
}

struct ProxyShared {
    target: SocketAddr,
    mode: AtomicU8,
    /// Bumped by `heal`; connections of earlier generations are closed and never forward again.
    generation: AtomicU64,
    shutdown: AtomicBool,
    accepted: AtomicUsize,
    next_id: AtomicU64,
    conns: Mutex<Vec<Conn>>,
}

impl ProxyShared {
    fn conns(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether bytes going `dir` are currently discarded.
    fn discards(&self, dir: Direction) -> bool {
        match self.mode.load(Ordering::SeqCst) {
            MODE_DROP_RESPONSES => dir == Direction::ServerToClient,
            MODE_BLACKHOLE => true,
            _ => false,
        }
    }
}

/// A TCP proxy on a free loopback port forwarding to a target, able to lose answers (server →
/// client bytes discarded), black-hole both directions, and heal (closing every connection that
/// existed, so clients reconnect). Built on std threads; works under any runtime.
pub struct Proxy {
    port: u16,
    shared: Arc<ProxyShared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Starts a proxy forwarding to `127.0.0.1:target_port`.
    pub fn start(target_port: u16) -> Proxy {
        Proxy::start_to(SocketAddr::from(([127, 0, 0, 1], target_port)))
    }

    /// Starts a proxy forwarding to `target`.
    pub fn start_to(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind 127.0.0.1:0");
        let port = listener.local_addr().expect("proxy local addr").port();
        let shared = Arc::new(ProxyShared {
            target,
            mode: AtomicU8::new(MODE_FORWARD),
            generation: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            accepted: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name(format!("proxy-accept-{port}"))
            .spawn(move || accept_loop(listener, accept_shared))
            .expect("spawn proxy accept thread");
        Proxy {
            port,
            shared,
            accept_thread: Some(accept_thread),
        }
    }

    /// The proxy's URL, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, server → client bytes are read and discarded on every connection (existing and
    /// new) while client → server bytes still pass: the server executes requests, the client never
    /// hears the answers.
    pub fn drop_responses(&self) {
        self.shared
            .mode
            .store(MODE_DROP_RESPONSES, Ordering::SeqCst);
    }

    /// From now on, bytes are discarded in both directions on every connection until `heal`.
    pub fn blackhole(&self) {
        self.shared.mode.store(MODE_BLACKHOLE, Ordering::SeqCst);
    }

    /// Stops discarding and closes every existing connection (both sockets), so clients reconnect
    /// on fresh connections; new connections forward both ways.
    pub fn heal(&self) {
        let mut conns = self.shared.conns();
        // Bump the generation before switching the mode back: a pump that sees the new mode also
        // sees the new generation and closes instead of resuming a half-dropped stream.
        let current = self.shared.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.shared.mode.store(MODE_FORWARD, Ordering::SeqCst);
        conns.retain(|conn| {
            if conn.generation < current {
                conn.close();
                false
            } else {
                true
            }
        });
    }

    /// How many client connections the proxy has accepted so far.
    pub fn connections_accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// How many proxied connections are open now.
    pub fn open_connections(&self) -> usize {
        self.shared.conns().len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // Unblock the accept call.
        let _ = TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_secs(1),
        );
        if let Some(handle) = self.accept_thread.take() {
            let _ = handle.join();
        }
        for conn in self.shared.conns().drain(..) {
            conn.close();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ProxyShared>) {
    loop {
        let accepted = listener.accept();
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                // E.g. EMFILE or ECONNABORTED: back off briefly instead of spinning.
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let server = match TcpStream::connect_timeout(&shared.target, Duration::from_secs(2)) {
            Ok(server) => server,
            Err(_) => {
                let _ = client.shutdown(Shutdown::Both);
                continue;
            }
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let clones = (
            client.try_clone(),
            server.try_clone(),
            client.try_clone(),
            server.try_clone(),
        );
        let (Ok(client_keep), Ok(server_keep), Ok(client_pump), Ok(server_pump)) = clones else {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
            continue;
        };
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        // Register under the lock that `heal` holds, so a connection is either closed by a heal or
        // belongs to the generation after it.
        let generation = {
            let mut conns = shared.conns();
            let generation = shared.generation.load(Ordering::SeqCst);
            conns.push(Conn {
                id,
                generation,
                client: client_keep,
                server: server_keep,
            });
            generation
        };
        let live = Arc::new(AtomicUsize::new(2));
        for (dir, src, dst) in [
            (Direction::ClientToServer, client, server),
            (Direction::ServerToClient, server_pump, client_pump),
        ] {
            let pump_shared = Arc::clone(&shared);
            let live = Arc::clone(&live);
            let spawned = thread::Builder::new()
                .name(format!("proxy-pump-{id}"))
                .spawn(move || {
                    pump(&pump_shared, dir, generation, src, dst);
                    if live.fetch_sub(1, Ordering::SeqCst) == 1 {
                        pump_shared.conns().retain(|conn| conn.id != id);
                    }
                });
            if spawned.is_err() {
                let mut conns = shared.conns();
                if let Some(conn) = conns.iter().find(|conn| conn.id == id) {
                    conn.close();
                }
                conns.retain(|conn| conn.id != id);
            }
        }
    }
}

/// Moves bytes from `src` to `dst` until EOF or an error, honouring the proxy's mode per chunk.
fn pump(
    shared: &ProxyShared,
    dir: Direction,
    generation: u64,
    mut src: TcpStream,
    mut dst: TcpStream,
) {
    let close_both = |src: &TcpStream, dst: &TcpStream| {
        let _ = src.shutdown(Shutdown::Both);
        let _ = dst.shutdown(Shutdown::Both);
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = src.read(&mut buf);
        // Mode first, then generation (see `Proxy::heal`).
        let discard = shared.discards(dir);
        if shared.generation.load(Ordering::SeqCst) != generation {
            // Healed since this connection was accepted: it may be half-dropped, never resume it.
            close_both(&src, &dst);
            return;
        }
        match read {
            Ok(0) => {
                // A discarded direction loses its FIN too: the peer hears nothing at all.
                if !discard {
                    let _ = dst.shutdown(Shutdown::Write);
                }
                return;
            }
            Ok(n) => {
                if discard {
                    continue;
                }
                if dst.write_all(&buf[..n]).is_err() {
                    close_both(&src, &dst);
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => {
                if !discard {
                    close_both(&src, &dst);
                }
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// OccupancyRecord
// ---------------------------------------------------------------------------------------------

/// An independent, cross-process record of how many jobs hold a slot at once, kept in a
/// directory: a file per current holder in `holders/`, and per-process append-only logs
/// `log-{pid}` of `enter {who} {ns} {count}` / `leave {who} {ns}` lines (ns since the UNIX epoch,
/// a clock shared by all processes on the host).
pub struct OccupancyRecord {
    dir: PathBuf,
}

impl OccupancyRecord {
    /// A record kept in `dir` (created if missing; may be shared with other processes).
    pub fn at(dir: &Path) -> OccupancyRecord {
        fs::create_dir_all(dir.join("holders"))
            .unwrap_or_else(|e| panic!("create {}/holders: {e}", dir.display()));
        OccupancyRecord {
            dir: dir.to_path_buf(),
        }
    }

    /// The record's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records that `who` now holds a slot and returns how many hold one (including `who`) as
    /// counted right after; panics if `who` already holds one. Call it once the slot is held.
    pub fn enter(&self, who: &str) -> usize {
        check_name(who);
        let holder = self.dir.join("holders").join(who);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&holder)
        {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                panic!(
                    "job {who} entered twice (holder file {} exists)",
                    holder.display()
                )
            }
            Err(e) => panic!("create holder file {}: {e}", holder.display()),
        }
        let count = holders_in(&self.dir);
        let ns = now_ns();
        self.append(&format!("enter {who} {ns} {count}\n"));
        count
    }

    /// Records that `who` no longer holds a slot; call it before the slot is given back. Panics if
    /// `who` did not hold one.
    pub fn leave(&self, who: &str) {
        check_name(who);
        let ns = now_ns();
        self.append(&format!("leave {who} {ns}\n"));
        let holder = self.dir.join("holders").join(who);
        fs::remove_file(&holder).unwrap_or_else(|e| {
            panic!("job {who} left without holding ({}): {e}", holder.display())
        });
    }

    /// The largest holder count any `enter` saw, over every process's log in `dir`.
    pub fn max_seen(dir: &Path) -> usize {
        read_events(dir)
            .into_iter()
            .filter_map(|event| match event {
                Event::Enter { count, .. } => Some(count),
                Event::Leave { .. } => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// The largest number of simultaneous holders, from the enter/leave events of every process's
    /// log in `dir` merged by timestamp (a leave and an enter at the same instant do not overlap).
    pub fn max_overlap(dir: &Path) -> usize {
        let mut events: Vec<(u128, i64)> = read_events(dir)
            .into_iter()
            .map(|event| match event {
                Event::Enter { ns, .. } => (ns, 1),
                Event::Leave { ns } => (ns, -1),
            })
            .collect();
        // At equal timestamps, leaves (-1) sort before enters (+1).
        events.sort_unstable();
        let (mut now, mut max) = (0i64, 0i64);
        for (_, delta) in events {
            now += delta;
            max = max.max(now);
        }
        usize::try_from(max).unwrap_or(0)
    }

    /// How many hold a slot now (holder files present in `dir/holders`).
    pub fn holders_now(dir: &Path) -> usize {
        holders_in(dir)
    }

    fn append(&self, line: &str) {
        let path = self.dir.join(format!("log-{}", std::process::id()));
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        // One write of one short line with O_APPEND: lines of concurrent writers never interleave.
        file.write_all(line.as_bytes())
            .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
    }
}

enum Event {
    Enter { ns: u128, count: usize },
    Leave { ns: u128 },
}

fn check_name(who: &str) {
    assert!(
        !who.is_empty() && !who.contains(['/', ' ', '\n', '\t', '\0']) && who != "." && who != "..",
        "holder name {who:?} must be a plain file name without whitespace"
    );
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("system clock before 1970")
        .as_nanos()
}

fn holders_in(dir: &Path) -> usize {
    match fs::read_dir(dir.join("holders")) {
        Ok(entries) => entries.filter(|entry| entry.is_ok()).count(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(e) => panic!("read {}/holders: {e}", dir.display()),
    }
}

fn read_events(dir: &Path) -> Vec<Event> {
    let mut events = Vec::new();
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        if !entry.file_name().to_string_lossy().starts_with("log-") {
            continue;
        }
        let path = entry.path();
        let mut text = String::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_string(&mut text))
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let parse_ns = |s: &str| -> u128 {
                s.parse().unwrap_or_else(|e| {
                    panic!("bad timestamp in {}: {line:?}: {e}", path.display())
                })
            };
            match fields.as_slice() {
                ["enter", _, ns, count] => events.push(Event::Enter {
                    ns: parse_ns(ns),
                    count: count.parse().unwrap_or_else(|e| {
                        panic!("bad count in {}: {line:?}: {e}", path.display())
                    }),
                }),
                ["leave", _, ns] => events.push(Event::Leave { ns: parse_ns(ns) }),
                _ => panic!("malformed line in {}: {line:?}", path.display()),
            }
        }
    }
    events
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
                data: new_data_dir(),
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
                server.etcd.data = new_data_dir();
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

/// The broker settings every etcd test uses: a short TTL (2 s, close to etcd's minimum) so
/// that lapses happen within a test, and short call bounds.
#[cfg(feature = "etcd")]
pub fn test_config(endpoint: &str, pool: &str, capacity: u32) -> leasehold::EtcdConfig {
    leasehold::EtcdConfig::new([endpoint], pool, capacity)
        .ttl(std::time::Duration::from_secs(2))
        .rpc_timeout(std::time::Duration::from_millis(500))
        .retry_for(std::time::Duration::from_secs(3))
}

/// Slot keys held right now in `pool` (default prefix), read straight from etcd: (key, lease).
#[cfg(feature = "etcd")]
pub async fn slot_keys(c: &mut etcd_client::Client, pool: &str) -> Vec<(String, i64)> {
    let resp = c
        .get(
            format!("leasehold/{pool}/slot/"),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    resp.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
        .collect()
}
