//! The console's HTTP API: the page, the snapshot and the event stream are served; every
//! refusal (actions off, no or a wrong token, another method than POST, another site, a foreign
//! host name, another content type, a malformed or oversized body, an unknown job, a stopped
//! supervisor) answers its 4xx/5xx with a stable JSON code and changes nothing; with the token,
//! the actions do what they say.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use leasehold::{CancellationToken, JobHandle, JobSpec, LeasePhase, Supervisor};
use leasehold_console::{
    ActionsToken, BODY_TIMEOUT, Console, ConsoleBuilder, ConsoleHandle, MAX_ACTION_BODY,
    MAX_STREAMS,
};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

const TOKEN: &str = "test-token-0123456789abcdef";
/// Bound on every wait for the console to show something (it samples ten times a second).
const WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// A minimal HTTP/1.1 client over a raw socket: every header is exactly what the test wrote.
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The error code of a refusal, after checking its status and content type.
    fn refused(&self, status: u16) -> String {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{self:?}"
        );
        let code = self.json()["error"]["code"]
            .as_str()
            .unwrap_or_else(|| panic!("no error code: {self:?}"))
            .to_owned();
        assert!(
            self.json()["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{self:?}"
        );
        code
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size = usize::from_str_radix(
            std::str::from_utf8(&raw[..line_end])
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .trim(),
            16,
        )
        .unwrap();
        raw = &raw[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

fn parse_head(head: &str) -> (u16, Vec<(String, String)>) {
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap();
            (n.trim().to_owned(), v.trim().to_owned())
        })
        .collect();
    (status, headers)
}

/// Sends `raw` as it is and reads the whole answer (`Connection: close`).
async fn send_raw(addr: SocketAddr, raw: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(raw).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut buf))
        .await
        .expect("the console answered within the bound")
        .unwrap();
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let (status, headers) = parse_head(std::str::from_utf8(&buf[..split]).unwrap());
    let mut body = buf[split + 4..].to_vec();
    let chunked = headers.iter().any(|(n, v)| {
        n.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}

/// A request with `Host` set to the console's address, `Content-Length` for the body,
/// `Connection: close`, and the extra headers given.
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut raw = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        raw.push_str(&format!("Host: {addr}\r\n"));
    }
    for (n, v) in headers {
        raw.push_str(&format!("{n}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        raw.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    raw.push_str("Connection: close\r\n\r\n");
    raw.push_str(body);
    send_raw(addr, raw.as_bytes()).await
}

/// Extra request headers, name and value.
type Headers<'a> = Vec<(&'a str, &'a str)>;

const BEARER: &str = "Bearer test-token-0123456789abcdef";

/// A POST as the console's own page sends it: JSON, the token, same origin.
async fn action(addr: SocketAddr, what: &str, body: &str) -> Reply {
    let origin = format!("http://{addr}");
    request(
        addr,
        "POST",
        &format!("/api/actions/{what}"),
        &[
            ("Content-Type", "application/json"),
            ("Authorization", BEARER),
            ("Origin", &origin),
            ("Sec-Fetch-Site", "same-origin"),
        ],
        body,
    )
    .await
}

/// An open event stream, read frame by frame.
struct Events {
    lines: BufReader<TcpStream>,
}

impl Events {
    async fn open(addr: SocketAddr) -> Result<Events, Reply> {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let raw = format!(
            "GET /api/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n"
        );
        stream.write_all(raw.as_bytes()).await.unwrap();
        let mut lines = BufReader::new(stream);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            lines.read_line(&mut line).await.unwrap();
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        let (status, headers) = parse_head(&head);
        if status != 200 {
            let mut body = String::new();
            // The refusal is small; its length says where it ends.
            let len: usize = headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                .map_or(0, |(_, v)| v.parse().unwrap());
            let mut buf = vec![0; len];
            lines.read_exact(&mut buf).await.unwrap();
            body.push_str(std::str::from_utf8(&buf).unwrap());
            return Err(Reply {
                status,
                headers,
                body,
            });
        }
        let ct = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.clone());
        assert_eq!(ct.as_deref(), Some("text/event-stream"));
        Ok(Events { lines })
    }

    /// The next frame (chunk-size lines and keep-alive comments skipped).
    async fn next(&mut self) -> Value {
        loop {
            let mut line = String::new();
            let n = tokio::time::timeout(WAIT, self.lines.read_line(&mut line))
                .await
                .expect("a frame within the bound")
                .unwrap();
            assert!(n > 0, "the event stream ended");
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return serde_json::from_str(data).unwrap();
            }
        }
    }

    /// Frames until one satisfies `pred` (bounded by WAIT).
    async fn until(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let frame = self.next().await;
            if pred(&frame) {
                return frame;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no frame showed {what}; last: {frame}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The test farm: a supervisor with one job running until it is cancelled.
// ---------------------------------------------------------------------------------------------

struct Farm {
    sup: Supervisor,
    console: ConsoleHandle,
    victim: JobHandle<(), std::io::Error>,
    /// The victim's own cancellation token, as its body sees it.
    victim_token: CancellationToken,
}

impl Farm {
    async fn start(actions: bool) -> Farm {
        let sup = Supervisor::builder().slots(2).start().await.unwrap();
        let mut builder = Console::builder(sup.clone()).allow_host("farm.internal");
        if actions {
            builder = builder.actions(ActionsToken::new(TOKEN).unwrap());
        }
        let console = builder.start().await.unwrap();
        let (tx, rx) = oneshot::channel();
        let victim = sup.submit(JobSpec::new("victim").unwrap(), move |ctx| async move {
            let _ = tx.send(ctx.cancellation_token());
            ctx.cancelled().await;
            // Cancellation wins over an ordinary error: LEASE_BODY_CANCELLED.
            Err::<(), _>(std::io::Error::other("cancelled"))
        });
        let victim_token = rx.await.unwrap();
        Farm {
            sup,
            console,
            victim,
            victim_token,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.console.local_addr()
    }

    /// Nothing changed: the victim runs, uncancelled, on a pool of 2 slots, nothing else held.
    /// (An action's answer comes after its effect: a refused one had none to wait for.)
    fn assert_unchanged(&self, after: &str) {
        assert!(
            !self.victim_token.is_cancelled(),
            "the victim was cancelled by {after}"
        );
        let stats = self.sup.stats();
        assert_eq!(stats.capacity, Some(2), "{after}: {stats:?}");
        assert_eq!(stats.active, 1, "{after}: {stats:?}");
        assert_eq!(stats.quarantined, 0, "{after}: {stats:?}");
        let leases = self.sup.leases();
        assert_eq!(leases.len(), 1, "{after}: {leases:?}");
        assert_eq!(leases[0].job_id.as_deref(), Some("victim"));
        assert_eq!(leases[0].phase, LeasePhase::Running);
    }

    async fn stop(self) {
        self.victim.cancel();
        let err = self.victim.join().await.unwrap_err();
        assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
        self.console.shutdown().await.unwrap();
        let report = self.sup.shutdown().await.unwrap();
        assert_eq!(report.quarantined, 0);
    }
}

// ---------------------------------------------------------------------------------------------
// What is served
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_and_its_assets_come_from_the_crate_under_a_strict_content_policy() {
    let farm = Farm::start(false).await;
    for (path, ct, needle) in [
        (
            "/",
            "text/html; charset=utf-8",
            "<title>leasehold console</title>",
        ),
        (
            "/console.js",
            "text/javascript; charset=utf-8",
            "EventSource",
        ),
        ("/console.css", "text/css; charset=utf-8", "--drain-gpu"),
    ] {
        let reply = request(farm.addr(), "GET", path, &[], "").await;
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        assert_eq!(reply.header("content-type"), Some(ct), "{path}");
        assert!(reply.body.contains(needle), "{path}");
        let csp = reply.header("content-security-policy").unwrap();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("script-src 'self'"),
            "{csp}"
        );
        assert_eq!(reply.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(reply.header("x-frame-options"), Some("DENY"));
        // Nothing from elsewhere: no absolute URL in the page.
        assert!(
            !reply.body.contains("https://"),
            "{path} loads from elsewhere"
        );
    }
    farm.stop().await;
}

/// Every response carries the security headers, refusals included, and a refusal by the host
/// guard is not dressed as a route's answer (no `Allow`); the page's icon is `204`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_refusals_included_carries_the_security_headers() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let evil = format!("evil.example:{}", addr.port());
    let replies = [
        (
            "snapshot",
            request(addr, "GET", "/api/snapshot", &[], "").await,
        ),
        ("404", request(addr, "GET", "/nothing-here", &[], "").await),
        (
            "405",
            request(addr, "GET", "/api/actions/cancel", &[], "").await,
        ),
        (
            "403 token",
            request(
                addr,
                "POST",
                "/api/actions/reclaim",
                &[("Content-Type", "application/json")],
                "{}",
            )
            .await,
        ),
        (
            "403 host, GET of a POST route",
            request(addr, "GET", "/api/actions/cancel", &[("Host", &evil)], "").await,
        ),
        (
            "403 host",
            request(addr, "GET", "/", &[("Host", &evil)], "").await,
        ),
        (
            "favicon",
            request(addr, "GET", "/favicon.ico", &[], "").await,
        ),
    ];
    for (what, reply) in &replies {
        let csp = reply.header("content-security-policy");
        assert!(
            csp.is_some_and(|c| c.contains("default-src 'none'")),
            "{what}: {reply:?}"
        );
        assert_eq!(
            reply.header("x-content-type-options"),
            Some("nosniff"),
            "{what}"
        );
        assert_eq!(reply.header("x-frame-options"), Some("DENY"), "{what}");
        assert_eq!(reply.header("cache-control"), Some("no-store"), "{what}");
    }
    let status = |what: &str| replies.iter().find(|(w, _)| *w == what).unwrap().1.status;
    assert_eq!(status("404"), 404);
    assert_eq!(status("405"), 405);
    assert_eq!(status("403 token"), 403);
    assert_eq!(status("favicon"), 204);
    for what in ["403 host, GET of a POST route", "403 host"] {
        let reply = &replies.iter().find(|(w, _)| *w == what).unwrap().1;
        assert_eq!(reply.refused(403), "CONSOLE_HOST_REFUSED", "{what}");
        assert_eq!(
            reply.header("allow"),
            None,
            "{what}: a refusal names no method"
        );
    }
    // The route's own 405 names what it allows.
    let reply = &replies.iter().find(|(w, _)| *w == "405").unwrap().1;
    assert_eq!(reply.header("allow"), Some("POST"));
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_binds_loopback_unless_the_embedder_names_an_address() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    assert!(console.local_addr().ip().is_loopback());
    assert_eq!(console.url(), format!("http://{}/", console.local_addr()));
    let reply = request(console.local_addr(), "GET", "/api/snapshot", &[], "").await;
    assert_eq!(reply.json()["exposed"], false, "loopback: no warning");
    // Beyond loopback (for a moment, read-only): the page is told to warn.
    let wide = Console::builder(sup.clone())
        .bind("0.0.0.0:0".parse().unwrap())
        .start()
        .await
        .unwrap();
    let here = SocketAddr::from(([127, 0, 0, 1], wide.local_addr().port()));
    let reply = request(here, "GET", "/api/snapshot", &[], "").await;
    assert_eq!(
        reply.json()["exposed"],
        true,
        "beyond loopback: the page warns"
    );
    wide.shutdown().await.unwrap();
    // The port is taken: a second console named on it cannot bind.
    let err = Console::builder(sup.clone())
        .bind(console.local_addr())
        .start()
        .await
        .unwrap_err();
    assert_eq!(err.code(), "CONSOLE_BIND_FAILED");
    assert!(std::error::Error::source(&err).is_some());
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
    assert_eq!(
        ActionsToken::new("short").unwrap_err().code(),
        "CONSOLE_TOKEN_INVALID"
    );
    assert_eq!(
        ActionsToken::new("sixteen bytes with spaces")
            .unwrap_err()
            .code(),
        "CONSOLE_TOKEN_INVALID"
    );
    let random = ActionsToken::random().unwrap();
    assert_eq!(random.expose().len(), 64);
    assert!(!format!("{random:?}").contains(random.expose()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_shows_a_lane_per_slot_with_the_running_job_and_the_stats() {
    let farm = Farm::start(false).await;
    let mut events = Events::open(farm.addr()).await.unwrap();
    // The victim was granted before the console's next frame.
    events
        .until("the victim running", |f| {
            f["lanes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l["lease"]["job_id"] == "victim")
        })
        .await;
    let reply = request(farm.addr(), "GET", "/api/snapshot", &[], "").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let frame = reply.json();
    let lanes = frame["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 2, "{frame}");
    let held: Vec<&Value> = lanes.iter().filter(|l| !l["lease"].is_null()).collect();
    assert_eq!(held.len(), 1, "{frame}");
    let lease = &held[0]["lease"];
    assert_eq!(lease["job_id"], "victim");
    assert_eq!(lease["phase"], "running");
    assert_eq!(lease["color"], "run");
    assert_eq!(lease["kind"], "job");
    assert_eq!(lease["priority"], "normal");
    assert_eq!(frame["stats"]["capacity"], 2);
    assert_eq!(frame["stats"]["active"], 1);
    assert_eq!(frame["queue"]["waiting"], 0);
    assert_eq!(frame["queue"]["listed"], false);
    assert_eq!(frame["actions"], false);
    assert!(
        frame.get("timeline").is_none(),
        "the timeline is its own route"
    );
    assert_eq!(frame["resizable"], true, "the in-process pool can resize");
    // The timeline, refreshed about once a second.
    let timeline = tokio::time::timeout(WAIT, async {
        loop {
            let tl = request(farm.addr(), "GET", "/api/timeline", &[], "")
                .await
                .json();
            if !tl["lanes"].as_array().unwrap().is_empty() {
                return tl;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the timeline shows the victim");
    let tl = timeline["lanes"].as_array().unwrap();
    assert_eq!(tl.len(), 1, "{timeline}");
    assert_eq!(tl[0]["segments"][0]["holder"], "victim");

    // The other slot held by an explicit lease, and a job queued behind it: the lanes show
    // the lease, the queue counts the waiter.
    let mut lease = farm.sup.acquire().await.unwrap();
    let queued = farm.sup.submit(
        JobSpec::new("queued")
            .unwrap()
            .with_priority(leasehold::Priority::High),
        |_ctx| async { Ok::<_, std::io::Error>(()) },
    );
    let frame = events
        .until("the explicit lease and one waiter", |f| {
            f["queue"]["waiting"] == 1
                && f["lanes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|l| l["lease"]["kind"] == "explicit")
        })
        .await;
    let explicit = frame["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["lease"]["kind"] == "explicit")
        .unwrap();
    assert!(explicit["lease"]["job_id"].is_null());
    assert_eq!(frame["stats"]["waiting"], 1);
    // The queue lists its caller, with its class and how long it has waited.
    let frame = events
        .until("the waiter listed", |f| f["queue"]["listed"] == true)
        .await;
    let waiters = frame["queue"]["waiters"].as_array().unwrap();
    assert_eq!(waiters.len(), 1, "{frame}");
    assert_eq!(waiters[0]["job_id"], "queued");
    assert_eq!(waiters[0]["priority"], "high");
    assert_eq!(waiters[0]["slots"], 1);
    assert!(waiters[0]["waited_ms"].is_u64());
    lease.release().await.unwrap();
    queued.join().await.unwrap();
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_sends_a_frame_at_once_and_then_ten_a_second() {
    let farm = Farm::start(false).await;
    let mut events = Events::open(farm.addr()).await.unwrap();
    let first = events.next().await;
    let mut last = first["now_ms"].as_u64().unwrap();
    for _ in 0..5 {
        let frame = events.next().await;
        let now = frame["now_ms"].as_u64().unwrap();
        assert!(now > last, "frames move forward: {last} then {now}");
        last = now;
    }
    farm.console.shutdown().await.unwrap();
    // The stream ends with the console.
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, events.lines.read_to_end(&mut rest))
        .await
        .expect("the stream ended when the console stopped")
        .unwrap();
    farm.victim.cancel();
    farm.victim.join().await.unwrap_err();
    farm.sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_event_streams_than_the_cap_are_refused_with_429_and_a_closed_one_frees_its_place() {
    let farm = Farm::start(false).await;
    let mut open = Vec::new();
    for _ in 0..MAX_STREAMS {
        open.push(Events::open(farm.addr()).await.unwrap());
    }
    let refused = match Events::open(farm.addr()).await {
        Err(reply) => reply,
        Ok(_) => panic!("stream {} was accepted", MAX_STREAMS + 1),
    };
    assert_eq!(refused.refused(429), "CONSOLE_TOO_MANY_STREAMS");
    drop(open.pop());
    // The closed stream's place is freed once the server has seen the connection go.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match Events::open(farm.addr()).await {
            Ok(_) => break,
            Err(reply) => {
                assert_eq!(reply.status, 429);
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the place was never freed"
                );
                tokio::task::yield_now().await;
            }
        }
    }
    drop(open);
    farm.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Refusals: each a stable code, none changes anything
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_are_refused_with_403_when_the_embedder_did_not_turn_them_on() {
    let farm = Farm::start(false).await;
    for (what, body) in [
        ("cancel", r#"{"job_id":"victim"}"#),
        ("reclaim", "{}"),
        ("resize", r#"{"slots":5}"#),
    ] {
        let reply = action(farm.addr(), what, body).await;
        assert_eq!(reply.refused(403), "CONSOLE_ACTIONS_DISABLED", "{what}");
        farm.assert_unchanged(what);
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_without_the_token_or_with_a_wrong_one_is_refused_with_403_and_changes_nothing() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let origin = format!("http://{addr}");
    let cookie = format!("token={TOKEN}");
    let wrong_same_length = format!("Bearer {}", "x".repeat(TOKEN.len()));
    let prefix = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let longer = format!("Bearer {TOKEN}0");
    let basic = format!("Basic {TOKEN}");
    let no_scheme = TOKEN.to_owned();
    let cases: Vec<(&str, Headers<'_>, String)> = vec![
        ("no token", vec![], "/api/actions/cancel".into()),
        (
            "a wrong token of the same length",
            vec![("Authorization", &wrong_same_length)],
            "/api/actions/cancel".into(),
        ),
        (
            "a prefix of the token",
            vec![("Authorization", &prefix)],
            "/api/actions/cancel".into(),
        ),
        (
            "the token and more",
            vec![("Authorization", &longer)],
            "/api/actions/cancel".into(),
        ),
        (
            "another scheme",
            vec![("Authorization", &basic)],
            "/api/actions/cancel".into(),
        ),
        (
            "no scheme",
            vec![("Authorization", &no_scheme)],
            "/api/actions/cancel".into(),
        ),
        (
            "the token in a cookie",
            vec![("Cookie", &cookie)],
            "/api/actions/cancel".into(),
        ),
        (
            "the token in the query",
            vec![],
            format!("/api/actions/cancel?token={TOKEN}"),
        ),
    ];
    for (why, extra, path) in cases {
        let mut headers = vec![
            ("Content-Type", "application/json"),
            ("Origin", origin.as_str()),
            ("Sec-Fetch-Site", "same-origin"),
        ];
        let sent_one = extra.iter().any(|(n, _)| *n == "Authorization");
        headers.extend(extra);
        let reply = request(addr, "POST", &path, &headers, r#"{"job_id":"victim"}"#).await;
        assert_eq!(reply.refused(403), "CONSOLE_FORBIDDEN", "{why}");
        // The same code, and words that say which it was: a wrong token is not a missing one.
        let message = reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        let (said, not_said) = if sent_one && why != "another scheme" && why != "no scheme" {
            ("the token is wrong", "no token")
        } else {
            ("no token", "the token is wrong")
        };
        assert!(
            message.contains(said) && !message.contains(not_said),
            "{why}: {message}"
        );
        farm.assert_unchanged(why);
    }
    // The same for the other actions.
    for (what, body) in [("reclaim", "{}"), ("resize", r#"{"slots":5}"#)] {
        let reply = request(
            addr,
            "POST",
            &format!("/api/actions/{what}"),
            &[("Content-Type", "application/json")],
            body,
        )
        .await;
        assert_eq!(reply.refused(403), "CONSOLE_FORBIDDEN", "{what}");
        farm.assert_unchanged(what);
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_method_but_post_on_an_action_is_refused_with_405_even_with_the_token() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    for what in ["cancel", "reclaim", "resize"] {
        for method in ["GET", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"] {
            let path = format!("/api/actions/{what}?job_id=victim&slots=5");
            let reply = request(
                addr,
                method,
                &path,
                &[
                    ("Authorization", BEARER),
                    ("Content-Type", "application/json"),
                ],
                if method == "PUT" || method == "PATCH" {
                    r#"{"job_id":"victim"}"#
                } else {
                    ""
                },
            )
            .await;
            assert_eq!(reply.status, 405, "{method} {what}: {reply:?}");
            assert_eq!(reply.header("allow"), Some("POST"), "{method} {what}");
            if method != "HEAD" {
                assert_eq!(reply.refused(405), "CONSOLE_METHOD_NOT_ALLOWED");
            }
            farm.assert_unchanged(&format!("{method} {what}"));
        }
    }
    // And the read-only routes take no POST.
    for path in ["/", "/api/snapshot", "/api/events"] {
        let reply = request(
            addr,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            "{}",
        )
        .await;
        assert_eq!(reply.refused(405), "CONSOLE_METHOD_NOT_ALLOWED", "{path}");
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_from_another_site_is_refused_with_403_even_with_the_token() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let other_port = format!("http://127.0.0.1:{}", addr.port().wrapping_add(1));
    let cases: Vec<(&str, Headers<'_>)> = vec![
        (
            "another site's Origin",
            vec![("Origin", "http://evil.example")],
        ),
        ("another port's Origin", vec![("Origin", &other_port)]),
        ("an opaque Origin", vec![("Origin", "null")]),
        (
            "Sec-Fetch-Site: cross-site",
            vec![("Sec-Fetch-Site", "cross-site")],
        ),
        (
            "Sec-Fetch-Site: same-site",
            vec![("Sec-Fetch-Site", "same-site")],
        ),
    ];
    for (why, extra) in cases {
        let mut headers = vec![
            ("Content-Type", "application/json"),
            ("Authorization", BEARER),
        ];
        headers.extend(extra);
        let reply = request(
            addr,
            "POST",
            "/api/actions/cancel",
            &headers,
            r#"{"job_id":"victim"}"#,
        )
        .await;
        assert_eq!(reply.refused(403), "CONSOLE_CROSS_SITE", "{why}");
        farm.assert_unchanged(why);
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_the_console_was_not_told_about_is_refused_on_every_route() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let evil = format!("evil.example:{}", addr.port());
    for (method, path) in [
        ("GET", "/"),
        ("GET", "/api/snapshot"),
        ("GET", "/api/events"),
        ("POST", "/api/actions/cancel"),
    ] {
        let reply = request(
            addr,
            method,
            path,
            &[
                ("Host", &evil),
                ("Content-Type", "application/json"),
                ("Authorization", BEARER),
            ],
            if method == "POST" {
                r#"{"job_id":"victim"}"#
            } else {
                ""
            },
        )
        .await;
        assert_eq!(
            reply.refused(403),
            "CONSOLE_HOST_REFUSED",
            "{method} {path}"
        );
        farm.assert_unchanged(path);
    }
    // No Host at all (HTTP/1.0) is refused too.
    let reply = send_raw(addr, b"GET /api/snapshot HTTP/1.0\r\n\r\n").await;
    assert_eq!(reply.refused(403), "CONSOLE_HOST_REFUSED");
    // localhost and the allowed name are answered.
    for host in [
        format!("localhost:{}", addr.port()),
        format!("farm.internal:{}", addr.port()),
    ] {
        let reply = request(addr, "GET", "/api/snapshot", &[("Host", &host)], "").await;
        assert_eq!(reply.status, 200, "{host}");
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_that_is_not_json_is_refused_with_415() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    for ct in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
    ] {
        let mut headers = vec![("Authorization", BEARER)];
        if let Some(ct) = ct {
            headers.push(("Content-Type", ct));
        }
        let reply = request(
            addr,
            "POST",
            "/api/actions/cancel",
            &headers,
            r#"{"job_id":"victim"}"#,
        )
        .await;
        assert_eq!(
            reply.refused(415),
            "CONSOLE_UNSUPPORTED_MEDIA_TYPE",
            "{ct:?}"
        );
        farm.assert_unchanged(&format!("{ct:?}"));
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_action_body_is_refused_with_400() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    for (what, body, cause) in [
        ("cancel", "", None),
        ("cancel", "{", None),
        ("cancel", "victim", None),
        ("cancel", "{}", None),
        ("cancel", r#"{"job_id":42}"#, None),
        ("cancel", r#"{"job_id":"victim","force":true}"#, None),
        ("cancel", r#"{"job_id":"../etc"}"#, Some("JOB_INVALID")),
        ("cancel", r#"{"job_id":""}"#, Some("JOB_INVALID")),
        ("reclaim", r#"{"all":true}"#, None),
        ("reclaim", "[]", None),
        ("resize", r#"{"slots":-1}"#, None),
        ("resize", r#"{"slots":"8"}"#, None),
        ("resize", r#"{"slots":4294967296}"#, None),
        ("resize", r#"{"slots":4097}"#, None),
        ("resize", r#"{"slots":0}"#, Some("LEASE_SLOT_COUNT_INVALID")),
        // A key twice: never a guess between two values.
        ("resize", r#"{"slots":2,"slots":64}"#, None),
        ("cancel", r#"{"job_id":"victim","job_id":"other"}"#, None),
    ] {
        let reply = action(addr, what, body).await;
        assert_eq!(reply.refused(400), "CONSOLE_BAD_REQUEST", "{what} {body}");
        assert_eq!(
            reply.json()["error"]["cause"].as_str(),
            cause,
            "{what} {body}"
        );
        farm.assert_unchanged(&format!("{what} {body}"));
    }
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_action_body_is_refused_with_413() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let origin = format!("http://{addr}");
    // Declared: refused from its Content-Length, before it is read.
    let big = format!(
        r#"{{"job_id":"victim","pad":"{}"}}"#,
        "x".repeat(MAX_ACTION_BODY)
    );
    let reply = action(addr, "cancel", &big).await;
    assert_eq!(reply.refused(413), "CONSOLE_PAYLOAD_TOO_LARGE");
    farm.assert_unchanged("a declared oversized body");
    // Chunked, no length: cut off at the limit while read.
    let chunk = "x".repeat(1024);
    let mut raw = format!(
        "POST /api/actions/cancel HTTP/1.1\r\nHost: {addr}\r\nOrigin: {origin}\r\n\
         Authorization: {BEARER}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    raw.push_str(&format!(
        "{:x}\r\n{{\"job_id\":\"victim\",\"pad\":\"\r\n",
        29
    ));
    for _ in 0..(MAX_ACTION_BODY / 1024 + 2) {
        raw.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
    }
    raw.push_str("2\r\n\"}\r\n0\r\n\r\n");
    let reply = send_raw(addr, raw.as_bytes()).await;
    assert_eq!(reply.refused(413), "CONSOLE_PAYLOAD_TOO_LARGE");
    farm.assert_unchanged("a chunked oversized body");
    farm.stop().await;
}

/// A body that stops arriving is given up at BODY_TIMEOUT with a 408 (on tokio's paused clock,
/// which jumps there once every task waits), changes nothing, and holds up nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_action_body_that_stops_arriving_is_refused_with_408() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let started = tokio::time::Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /api/actions/cancel HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {BEARER}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\nConnection: close\r\n\r\n\
         {{\"job_id\":"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    // Bounded well past BODY_TIMEOUT, so that a missing timeout fails instead of hanging.
    tokio::time::timeout(BODY_TIMEOUT * 6, stream.read_to_end(&mut buf))
        .await
        .expect("the console gave up on the body")
        .unwrap();
    assert!(started.elapsed() >= BODY_TIMEOUT);
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let (status, headers) = parse_head(head);
    let reply = Reply {
        status,
        headers,
        body: body.to_owned(),
    };
    assert_eq!(reply.refused(408), "CONSOLE_REQUEST_TIMEOUT");
    farm.assert_unchanged("a stalled body");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_job_or_route_is_404() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let reply = action(addr, "cancel", r#"{"job_id":"no-such-job"}"#).await;
    assert_eq!(reply.refused(404), "CONSOLE_NOT_FOUND");
    farm.assert_unchanged("an unknown job id");
    for path in [
        "/api/actions/kill",
        "/api/nothing",
        "/index.php",
        "/api/actions",
    ] {
        let reply = request(addr, "GET", path, &[], "").await;
        assert_eq!(reply.refused(404), "CONSOLE_NOT_FOUND", "{path}");
    }
    let reply = action(addr, "kill", r#"{"job_id":"victim"}"#).await;
    assert_eq!(reply.refused(404), "CONSOLE_NOT_FOUND");
    farm.assert_unchanged("an unknown action");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_on_a_stopped_supervisor_is_503_supervisor_stopped() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    farm.sup.shutdown().await.unwrap();
    for (what, body) in [
        ("cancel", r#"{"job_id":"victim"}"#),
        ("reclaim", "{}"),
        ("resize", r#"{"slots":3}"#),
    ] {
        let reply = action(addr, what, body).await;
        assert_eq!(reply.refused(503), "CONSOLE_SUPERVISOR_STOPPED", "{what}");
        assert_eq!(reply.json()["error"]["cause"], "SUPERVISOR_STOPPED");
    }
    // The page still serves what it last knew.
    assert_eq!(
        request(addr, "GET", "/api/snapshot", &[], "").await.status,
        200
    );
    assert_eq!(
        farm.victim.join().await.unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    farm.console.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Accepted actions, outcomes, quarantine
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_token_cancel_and_resize_do_what_they_say() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let reply = action(addr, "resize", r#"{"slots":3}"#).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["capacity"], 3);
    // The answer comes after the effect.
    assert_eq!(farm.sup.stats().capacity, Some(3));

    // The page's origin by https (the console behind a TLS-terminating proxy) is its own.
    let https = format!("https://{addr}");
    let reply = request(
        addr,
        "POST",
        "/api/actions/resize",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", BEARER),
            ("Origin", &https),
            ("Sec-Fetch-Site", "same-origin"),
        ],
        r#"{"slots":4}"#,
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(farm.sup.stats().capacity, Some(4));

    // A command-line client (no Origin, no Sec-Fetch-Site) with the token is not another site.
    let reply = request(
        addr,
        "POST",
        "/api/actions/cancel",
        &[
            ("Content-Type", "application/json; charset=utf-8"),
            ("Authorization", BEARER),
        ],
        r#"{"job_id":"victim"}"#,
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["cancel_requested"], true);
    assert!(farm.victim_token.is_cancelled());
    assert_eq!(
        farm.victim.join().await.unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    // Gone now: a second cancel finds nothing.
    let reply = action(addr, "cancel", r#"{"job_id":"victim"}"#).await;
    assert_eq!(reply.refused(404), "CONSOLE_NOT_FOUND");
    farm.console.shutdown().await.unwrap();
    farm.sup.shutdown().await.unwrap();
}

/// A job whose temp dir was replaced by a file: its removal fails and the slot is quarantined
/// (as in tests/quarantine.rs). The console lists it with the reason; a reclaim with the token,
/// once the file is gone, frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_slot_is_listed_with_its_reason_and_reclaimed_with_the_token() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let mut events = Events::open(addr).await.unwrap();
    let (dir_tx, dir_rx) = oneshot::channel();
    let err = farm
        .sup
        .run(JobSpec::new("clobbered").unwrap(), |ctx| async move {
            let _ = dir_tx.send(support::clobber_temp_dir(&ctx)?);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED");
    let path = dir_rx.await.unwrap();
    let frame = events
        .until("the quarantined slot's reason", |f| {
            f["quarantined"].as_array().unwrap().iter().any(|q| {
                q["job_id"] == "clobbered"
                    && q["reason"]
                        .as_str()
                        .is_some_and(|r| r.contains("could not be removed"))
            })
        })
        .await;
    let lane = frame["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["lease"]["job_id"] == "clobbered")
        .expect("the quarantined lease keeps its lane");
    assert_eq!(lane["lease"]["phase"], "quarantined");
    assert_eq!(lane["lease"]["color"], "quarantined");
    assert!(
        lane["lease"]["reason"]
            .as_str()
            .unwrap()
            .contains("could not be removed")
    );
    assert_eq!(frame["stats"]["quarantined"], 1);

    std::fs::remove_file(&path).unwrap();
    let reply = action(addr, "reclaim", "{}").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(
        reply.json()["reclaimed"].as_array().unwrap().len(),
        1,
        "{reply:?}"
    );
    events
        .until("the quarantine emptied", |f| {
            f["quarantined"].as_array().unwrap().is_empty() && f["stats"]["quarantined"] == 0
        })
        .await;
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_outcomes_show_recorded_codes_and_observed_job_ends() {
    let farm = Farm::start(false).await;
    let addr = farm.addr();
    let outcomes = farm.console.outcomes();
    let mut events = Events::open(addr).await.unwrap();

    // Reported only: too short to be sampled, or never granted.
    let result = farm
        .sup
        .run(JobSpec::new("quick").unwrap(), |_ctx| async {
            Ok::<_, std::io::Error>(1)
        })
        .await;
    outcomes.record("quick", &result);
    let failed = farm
        .sup
        .run(JobSpec::new("broken").unwrap(), |_ctx| async {
            Err::<(), _>(std::io::Error::other("scene file is corrupt"))
        })
        .await;
    outcomes.record("broken", &failed);

    // Observed: held until the console has shown it, then let go, and not reported.
    let (gate_tx, gate_rx) = oneshot::channel::<()>();
    let gated = farm
        .sup
        .submit(JobSpec::new("gated").unwrap(), move |_ctx| async move {
            let _ = gate_rx.await;
            Ok::<_, std::io::Error>(())
        });
    events
        .until("the gated job running", |f| {
            f["lanes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l["lease"]["job_id"] == "gated")
        })
        .await;
    gate_tx.send(()).unwrap();
    gated.join().await.unwrap();
    let frame = events
        .until("the gated job's end", |f| {
            f["outcomes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|o| o["job_id"] == "gated")
        })
        .await;
    let rows = frame["outcomes"].as_array().unwrap();
    let row = |job: &str| rows.iter().find(|o| o["job_id"] == job).unwrap().clone();
    assert_eq!(row("quick")["code"], "OK");
    assert_eq!(row("broken")["code"], "LEASE_BODY_FAILED");
    // One phrase: the body's own error, without "job failed: job body failed: ...".
    assert_eq!(row("broken")["detail"], "scene file is corrupt");
    assert_eq!(row("broken")["errors"]["summary"], "job failed");
    let gated_row = row("gated");
    assert!(gated_row["code"].is_null(), "{gated_row}");
    assert!(gated_row["slot"].is_u64());
    assert!(gated_row["last_phase"].is_string());
    // Newest first.
    assert_eq!(rows[0]["job_id"], "gated");
    farm.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Slow and idle clients
// ---------------------------------------------------------------------------------------------

/// Opens `n` connections that each send an unfinished header line and then nothing.
async fn slow_clients(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        // A connection the console closed already (beyond its cap) may refuse the write.
        let _ = stream
            .write_all(b"GET /api/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            .await;
        clients.push(stream);
    }
    clients
}

/// Waits until the snapshot is served again: the console closes a request at once while its
/// places are still held by connections it has not seen end yet.
async fn snapshot_answers(addr: SocketAddr) {
    let raw = format!("GET /api/snapshot HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    tokio::time::timeout(WAIT, async {
        loop {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let mut reply = Vec::new();
            if stream.write_all(raw.as_bytes()).await.is_ok()
                && stream.read_to_end(&mut reply).await.is_ok()
                && reply.starts_with(b"HTTP/1.1 200")
            {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the snapshot is served again");
}

/// Whether the console closed the connection (end of stream or a reset) within `bound`.
async fn closed_within(mut stream: TcpStream, bound: Duration) -> bool {
    let mut buf = [0u8; 512];
    tokio::time::timeout(bound, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                // Whatever the console answers (nothing is expected), keep reading to the end.
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// A zero header-read or write timeout is refused at the builder's call, with a panic that
/// names the setting: zero would close every connection (headers) or every connection whose
/// write has to wait a moment (writes). The shortest positive ones are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_header_read_or_write_timeout_is_refused() {
    type Set = fn(ConsoleBuilder, Duration) -> ConsoleBuilder;
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    for (name, set) in [
        (
            "header_read_timeout",
            ConsoleBuilder::header_read_timeout as Set,
        ),
        ("write_timeout", ConsoleBuilder::write_timeout as Set),
    ] {
        let err = set(Console::builder(sup.clone()), Duration::ZERO)
            .start()
            .await
            .expect_err(&format!("a zero {name} was taken"));
        assert_eq!(err.code(), "CONSOLE_LIMIT_INVALID", "{name}: {err}");
        assert_eq!(
            err.to_string(),
            format!("the console's {name} must be positive")
        );
    }
    let console = Console::builder(sup.clone())
        .header_read_timeout(Duration::from_nanos(1))
        .write_timeout(Duration::from_nanos(1))
        .start()
        .await
        .unwrap();
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_once() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let console = Console::builder(sup.clone())
        .max_connections(4)
        // Long enough that nothing here is closed by it.
        .header_read_timeout(Duration::from_secs(600))
        .start()
        .await
        .unwrap();
    let addr = console.local_addr();
    let mut clients = slow_clients(addr, 12).await;
    let beyond = clients.split_off(4);
    for stream in beyond {
        assert!(
            closed_within(stream, WAIT).await,
            "a connection beyond the cap was left open"
        );
    }
    // The first four hold the console's places; once they go, it answers again.
    drop(clients);
    snapshot_answers(addr).await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// A flood of slow clients (each sends an unfinished header line, then nothing) costs the
/// console its own connections only: those beyond the cap are closed at once, the others when
/// their headers have not arrived within the header-read timeout; jobs that make files all
/// along never lack a descriptor, and the snapshot answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_slow_clients_is_closed_by_the_console_and_costs_jobs_no_file_descriptor() {
    // A common default: 1 024 descriptors for the whole process. The 600 slow clients below
    // hold 600 of them here; a console that held a socket for each of them too would leave
    // the jobs none.
    let limit = FdLimit::set(1024);
    let (sup, _root) = support::pool(2).await;
    let console = Console::builder(sup.clone())
        .max_connections(32)
        .header_read_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let addr = console.local_addr();
    let clients = slow_clients(addr, 600).await;
    // Jobs that each open files in their temp dirs while the flood lasts.
    for n in 0..20 {
        let written = sup
            .run(
                JobSpec::new(format!("during-the-flood-{n}")).unwrap(),
                |ctx| async move {
                    std::fs::write(ctx.temp_dir().join("frame.bin"), [0u8; 64])?;
                    Ok::<_, std::io::Error>(())
                },
            )
            .await;
        written.unwrap_or_else(|e| panic!("a job failed during the flood: {e}"));
    }
    let closing: Vec<_> = clients
        .into_iter()
        .map(|s| tokio::spawn(closed_within(s, Duration::from_secs(30))))
        .collect();
    let mut closed = 0;
    for c in closing {
        closed += usize::from(c.await.unwrap());
    }
    assert!(
        closed * 10 >= 600 * 9,
        "only {closed} of 600 slow clients closed by the console"
    );
    snapshot_answers(addr).await;
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
    drop(limit);
}

/// Sends `GET path` from a socket with a small receive buffer, reads the answer's head (so the
/// console has begun to answer) and no more: the status, and the socket, never read again.
async fn stop_reading_after_the_head(addr: SocketAddr, path: &str) -> (u16, TcpStream) {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    // Both before connecting: the window the console may fill stays small, and so does the
    // send buffer Linux gives the console's socket, which it sizes from the segment size the
    // client announces (on loopback, 64 KiB segments would give it megabytes to fill).
    socket.set_recv_buffer_size(4096).unwrap();
    socket.set_tcp_mss(536).unwrap();
    socket.set_nonblocking(true).unwrap();
    let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
    let mut stream = socket.connect(addr).await.unwrap();
    let raw = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    tokio::time::timeout(WAIT, async {
        while !head.ends_with(b"\r\n\r\n") {
            head.push(stream.read_u8().await.unwrap());
        }
    })
    .await
    .expect("the console answered within the bound");
    let (status, _) = parse_head(std::str::from_utf8(&head).unwrap());
    (status, stream)
}

/// Fills the history with a thousand job ends, each with a long job id and a long note.
fn long_job_ends(console: &ConsoleHandle) {
    let outcomes = console.outcomes();
    let ok: Result<(), leasehold::JobError<String>> = Ok(());
    for i in 0..1000 {
        let note = leasehold_console::JobNote::new().note("x".repeat(300));
        outcomes.record_with(&format!("bake-{i:04}-{}", "y".repeat(200)), &ok, note);
    }
}

/// A console for clients that stop reading: at most `max_connections` connections, a write
/// timeout of 300 ms, and a history of [`long_job_ends`], so that its answers and frames soon
/// outgrow a socket's buffers.
async fn console_for_stalled_readers(sup: &Supervisor, max_connections: usize) -> ConsoleHandle {
    let console = Console::builder(sup.clone())
        .max_connections(max_connections)
        .write_timeout(Duration::from_millis(300))
        .start()
        .await
        .unwrap();
    long_job_ends(&console);
    console
}

/// Clients that open the event stream and then stop reading: once their sockets' buffers are
/// full, the console's writes make no progress, and it closes them after the write timeout,
/// which frees their stream places (and their connections): a new stream is accepted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_whose_clients_stopped_reading_are_closed_and_free_their_places() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    // Frames of several KB (the newest job ends, with long ids and notes): ten a second fill
    // a socket's buffers within a second or two.
    let console = console_for_stalled_readers(&sup, MAX_STREAMS + 4).await;
    let addr = console.local_addr();
    // Every stream place is taken by a client that reads no more.
    let mut stalled = Vec::with_capacity(MAX_STREAMS);
    for _ in 0..MAX_STREAMS {
        let (status, stream) = stop_reading_after_the_head(addr, "/api/events").await;
        assert_eq!(status, 200);
        stalled.push(stream);
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match Events::open(addr).await {
            Ok(mut events) => {
                events.next().await;
                break;
            }
            Err(reply) => {
                assert_eq!(reply.refused(429), "CONSOLE_TOO_MANY_STREAMS");
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "clients that stopped reading still hold every stream place"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    for stream in stalled {
        assert!(
            closed_within(stream, WAIT).await,
            "an event stream whose client stopped reading was left open"
        );
    }
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// A large answer to a client that stops reading holds the console's only connection until
/// the write timeout: then it is closed, and the snapshot is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_to_a_client_that_stopped_reading_frees_its_connection() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    // 500 rows of long job ends: an answer far larger than the socket's buffers.
    let console = console_for_stalled_readers(&sup, 1).await;
    let addr = console.local_addr();
    let (status, stalled) = stop_reading_after_the_head(addr, "/api/history?limit=500").await;
    assert_eq!(status, 200);
    snapshot_answers(addr).await;
    assert!(
        closed_within(stalled, WAIT).await,
        "a large answer whose client stopped reading was left open"
    );
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// The process's soft limit on open file descriptors, lowered for a test and put back after.
struct FdLimit(rustix::process::Rlimit);

impl FdLimit {
    fn set(soft: u64) -> Self {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let old = getrlimit(Resource::Nofile);
        let new = Rlimit {
            current: Some(old.maximum.map_or(soft, |hard| hard.min(soft))),
            maximum: old.maximum,
        };
        setrlimit(Resource::Nofile, new).expect("the soft limit can be lowered");
        Self(old)
    }
}

impl Drop for FdLimit {
    fn drop(&mut self) {
        let old = rustix::process::Rlimit {
            current: self.0.current,
            maximum: self.0.maximum,
        };
        let _ = rustix::process::setrlimit(rustix::process::Resource::Nofile, old);
    }
}

/// With 262 callers waiting and a full history, a frame stays under 5 KB: the queue lists its
/// first rows and a count (`/api/queue` searches the rest), the history its newest rows
/// (`/api/history` filters and searches the rest), the timeline is its own route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_stays_under_5_kb_with_262_waiters_and_the_rest_is_searched() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let addr = console.local_addr();
    let outcomes = console.outcomes();
    for i in 0..1000 {
        let result: Result<(), leasehold::JobError<std::io::Error>> = if i % 3 == 0 {
            Err(leasehold::JobError::Acquire(
                leasehold::AcquireError::Cancelled,
            ))
        } else {
            Ok(())
        };
        outcomes.record(&format!("bake-{i:04}"), &result);
    }
    let (gate_tx, gate_rx) = oneshot::channel::<()>();
    let holder = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("holder").unwrap(), |_ctx| async move {
                let _ = gate_rx.await;
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    // The holder has the slot before anyone queues behind it.
    tokio::time::timeout(WAIT, async {
        while !sup
            .leases()
            .iter()
            .any(|l| l.job_id.as_deref() == Some("holder"))
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the holder runs");
    // Submitted one after another from this task: they join the queue in this order.
    let waiters: Vec<_> = (0..262)
        .map(|i| {
            sup.submit(
                JobSpec::new(format!("waiter-{i:03}")).unwrap(),
                |_ctx| async { Ok::<_, std::io::Error>(()) },
            )
        })
        .collect();
    // The poller lists the queue about once a second.
    let frame = tokio::time::timeout(WAIT, async {
        loop {
            let reply = request(addr, "GET", "/api/snapshot", &[], "").await;
            if reply.json()["queue"]["listed_count"] == 262 {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the queue listed");
    let size = frame.body.len();
    eprintln!("a frame with 262 waiters and 1000 job ends in the history: {size} bytes");
    assert!(size <= 5 * 1024, "{size} bytes: {}", frame.body);
    let frame = frame.json();
    assert_eq!(frame["queue"]["waiting"], 262);
    assert!(frame["queue"]["waiters"].as_array().unwrap().len() < 262);
    assert_eq!(frame["outcomes"][0]["job_id"], "bake-0999");
    // The rest, searched.
    let found = request(addr, "GET", "/api/queue?q=waiter-25", &[], "")
        .await
        .json();
    let ids: Vec<&str> = found["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["job_id"].as_str().unwrap())
        .collect();
    // In the order they are served: the full listing's order.
    let all = request(addr, "GET", "/api/queue?limit=500", &[], "")
        .await
        .json();
    let all: Vec<&str> = all["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(all.len(), 262);
    assert_eq!(
        frame["queue"]["waiters"][0]["job_id"], all[0],
        "the frame lists the first"
    );
    let expected: Vec<&str> = all
        .iter()
        .copied()
        .filter(|id| id.contains("waiter-25"))
        .collect();
    assert_eq!(expected.len(), 10);
    assert_eq!(ids, expected, "in the order they are served");
    assert_eq!(found["listed"], 262);
    let history = request(
        addr,
        "GET",
        "/api/history?code=LEASE_ACQUIRE_CANCELLED&q=bake-09&limit=5",
        &[],
        "",
    )
    .await
    .json();
    let ids: Vec<&str> = history["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            "bake-0999",
            "bake-0996",
            "bake-0993",
            "bake-0990",
            "bake-0987"
        ]
    );
    assert_eq!(history["total"], 1000);
    assert!(
        history["rows"][0]["errors"]["acquire"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{history}"
    );
    let refused = request(
        addr,
        "GET",
        &format!("/api/history?q={}", "x".repeat(200)),
        &[],
        "",
    )
    .await;
    assert_eq!(refused.refused(400), "CONSOLE_BAD_REQUEST");
    let timeline = request(addr, "GET", "/api/timeline", &[], "").await.json();
    assert!(timeline["window_ms"].as_u64().is_some(), "{timeline}");
    gate_tx.send(()).unwrap();
    holder.await.unwrap().unwrap();
    for w in waiters {
        w.join().await.unwrap();
    }
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// The GPU panel's data: per device its adapter, its sub-slots in use and how often it was
/// re-created, read from `Supervisor::gpu_devices` with every frame. Skips loudly without a GPU
/// adapter (a failure under `LEASEHOLD_REQUIRE_GPU=1`, as in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_frame_shows_each_gpu_device_and_its_sub_slots_in_use() {
    let started = Supervisor::builder()
        .gpu(leasehold::GpuOptions::new().slots_per_device(2))
        .start()
        .await;
    let sup = match started {
        Ok(sup) => sup,
        Err(leasehold::StartError::Gpu(leasehold::GpuError::NoAdapter)) => {
            assert_ne!(
                std::env::var("LEASEHOLD_REQUIRE_GPU").as_deref(),
                Ok("1"),
                "LEASEHOLD_REQUIRE_GPU=1 but no GPU adapter was found"
            );
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIPPED: no GPU adapter: the console's GPU panel test did not run ***\n"
            );
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let addr = console.local_addr();
    let (running_tx, running_rx) = oneshot::channel();
    let (gate_tx, gate_rx) = oneshot::channel::<()>();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("on-the-gpu").unwrap(), |ctx| async move {
                assert!(ctx.gpu().is_some());
                running_tx.send(()).unwrap();
                let _ = gate_rx.await;
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    running_rx.await.unwrap();
    let gpu = tokio::time::timeout(WAIT, async {
        loop {
            let frame = request(addr, "GET", "/api/snapshot", &[], "").await.json();
            if frame["gpu"][0]["in_use"] == 1 {
                return frame["gpu"].clone();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the device shows its sub-slot in use");
    assert_eq!(gpu.as_array().unwrap().len(), 1, "{gpu}");
    assert_eq!(gpu[0]["sub_slots"], 2);
    assert_eq!(gpu[0]["adopted"], false);
    assert_eq!(gpu[0]["recreated"], 0);
    assert!(gpu[0]["lost"].is_null());
    assert!(gpu[0]["adapter"].as_str().is_some_and(|a| !a.is_empty()));
    gate_tx.send(()).unwrap();
    job.await.unwrap().unwrap();
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// A broker of the user's own decides its capacity: the frame says resize cannot work, so the
/// page does not offer it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resize_is_not_offered_on_a_broker_that_decides_its_own_capacity() {
    struct OneSlot(std::sync::atomic::AtomicU64);
    impl leasehold::SlotBroker for OneSlot {
        async fn acquire(
            &self,
            _request: leasehold::AcquireRequest,
        ) -> Result<leasehold::SlotToken, leasehold::BrokerError> {
            let lease = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(leasehold::SlotToken::new(0, lease))
        }
        async fn release(
            &self,
            _token: leasehold::SlotToken,
        ) -> Result<(), leasehold::BrokerError> {
            Ok(())
        }
        fn capacity(&self) -> Option<u32> {
            Some(1)
        }
    }
    let sup = Supervisor::builder()
        .broker(OneSlot(std::sync::atomic::AtomicU64::new(1)))
        .start()
        .await
        .unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let frame = request(console.local_addr(), "GET", "/api/snapshot", &[], "")
        .await
        .json();
    assert_eq!(frame["resizable"], false, "{frame}");
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Actions act on exactly what was confirmed
// ---------------------------------------------------------------------------------------------

/// The lease the victim holds now.
fn lease_of(sup: &Supervisor, job: &str) -> u64 {
    sup.leases()
        .iter()
        .find(|l| l.job_id.as_deref() == Some(job))
        .and_then(|l| l.tokens.first())
        .map(|t| t.lease_id())
        .unwrap_or_else(|| panic!("{job} holds no lease"))
}

/// A cancel names the job and the lease the user confirmed: refused with
/// `CONSOLE_TARGET_CHANGED` once that lease has ended or is another job's, with
/// `CONSOLE_TARGET_AMBIGUOUS` when the job id also names another lease (a cancel by id would
/// reach it too); nothing is cancelled then. The right pair cancels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_a_lease_that_is_no_longer_the_jobs_is_refused_and_cancels_nothing() {
    let farm = Farm::start(true).await;
    let addr = farm.addr();
    let victim_lease = lease_of(&farm.sup, "victim");

    // A lease that has ended: an earlier job's.
    let done = farm
        .sup
        .run(JobSpec::new("earlier").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>(ctx.lease_id())
        })
        .await
        .unwrap();
    let body = format!(r#"{{"job_id":"victim","lease_id":{done}}}"#);
    let reply = action(addr, "cancel", &body).await;
    assert_eq!(reply.refused(409), "CONSOLE_TARGET_CHANGED", "{reply:?}");
    farm.assert_unchanged("a cancel of an ended lease");
    // The victim's lease, named for another job.
    let body = format!(r#"{{"job_id":"earlier","lease_id":{victim_lease}}}"#);
    let reply = action(addr, "cancel", &body).await;
    assert_eq!(reply.refused(409), "CONSOLE_TARGET_CHANGED", "{reply:?}");
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`victim`'s"),
        "{reply:?}"
    );
    farm.assert_unchanged("a cancel naming another job's lease");
    // Not an id: refused before anything is looked at.
    let reply = action(addr, "cancel", r#"{"job_id":"victim","lease_id":-1}"#).await;
    assert_eq!(reply.refused(400), "CONSOLE_BAD_REQUEST");

    // A second run of the id "victim" holds the other slot: a cancel by id would reach both.
    let (gate, gate_rx) = oneshot::channel::<()>();
    let (lease_tx, lease_rx) = oneshot::channel();
    let twin = farm
        .sup
        .submit(JobSpec::new("victim").unwrap(), move |ctx| async move {
            let _ = lease_tx.send((ctx.lease_id(), ctx.cancellation_token()));
            let _ = gate_rx.await;
            Ok::<_, std::io::Error>(())
        });
    let (twin_lease, twin_token) = lease_rx.await.unwrap();
    let body = format!(r#"{{"job_id":"victim","lease_id":{victim_lease}}}"#);
    let reply = action(addr, "cancel", &body).await;
    assert_eq!(reply.refused(409), "CONSOLE_TARGET_AMBIGUOUS", "{reply:?}");
    assert!(!farm.victim_token.is_cancelled() && !twin_token.is_cancelled());
    let _ = twin_lease;
    gate.send(()).unwrap();
    twin.join().await.unwrap();

    // The pair confirmed, as it is: cancelled.
    let reply = action(addr, "cancel", &body).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["lease_id"], victim_lease);
    assert!(farm.victim_token.is_cancelled());
    assert_eq!(
        farm.victim.join().await.unwrap_err().code(),
        "LEASE_BODY_CANCELLED"
    );
    farm.console.shutdown().await.unwrap();
    farm.sup.shutdown().await.unwrap();
}

/// A reclaim names the quarantined leases the user confirmed: refused with
/// `CONSOLE_TARGET_CHANGED` when another is quarantined (the reclaim would check it too); a
/// resize names the capacity it was confirmed from: refused when it is another now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_or_a_resize_confirmed_on_another_state_is_refused_and_changes_nothing() {
    let (sup, _root) = support::pool(3).await;
    let console = Console::builder(sup.clone())
        .actions(ActionsToken::new(TOKEN).unwrap())
        .start()
        .await
        .unwrap();
    let addr = console.local_addr();
    let mut dirs = Vec::new();
    for id in ["first", "second"] {
        let (dir_tx, dir_rx) = oneshot::channel();
        let err = sup
            .run(JobSpec::new(id).unwrap(), |ctx| async move {
                let _ = dir_tx.send(support::clobber_temp_dir(&ctx)?);
                Ok::<_, std::io::Error>(())
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED");
        let dir = dir_rx.await.unwrap();
        std::fs::remove_file(&dir).unwrap();
        dirs.push(dir);
    }
    let quarantined = sup.quarantined().await.unwrap();
    assert_eq!(quarantined.len(), 2);
    let first = quarantined
        .iter()
        .find(|q| q.job_id.as_deref() == Some("first"))
        .unwrap()
        .token
        .lease_id();
    let second = quarantined
        .iter()
        .find(|q| q.job_id.as_deref() == Some("second"))
        .unwrap()
        .token
        .lease_id();
    // Confirmed when only the first was quarantined: refused, both still quarantined.
    let reply = action(addr, "reclaim", &format!(r#"{{"lease_ids":[{first}]}}"#)).await;
    assert_eq!(reply.refused(409), "CONSOLE_TARGET_CHANGED", "{reply:?}");
    assert_eq!(sup.stats().quarantined, 2);
    let reply = action(
        addr,
        "reclaim",
        &format!(r#"{{"lease_ids":[{first},{second}]}}"#),
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["reclaimed"].as_array().unwrap().len(), 2);
    assert_eq!(sup.stats().quarantined, 0);

    // A resize confirmed from 2 slots, on a pool of 3: refused.
    let reply = action(addr, "resize", r#"{"slots":5,"from":2}"#).await;
    assert_eq!(reply.refused(409), "CONSOLE_TARGET_CHANGED", "{reply:?}");
    assert_eq!(sup.stats().capacity, Some(3));
    let reply = action(addr, "resize", r#"{"slots":5,"from":3}"#).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(sup.stats().capacity, Some(5));
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}

/// The history in pages: `before` cuts at a row, so a page of older rows does not move while
/// newer ends arrive; each page says where it stands (`matched`, `newer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_is_served_in_pages_cut_at_a_row() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let console = Console::builder(sup.clone()).start().await.unwrap();
    let addr = console.local_addr();
    let outcomes = console.outcomes();
    let ok = Ok::<_, leasehold::JobError<std::io::Error>>(());
    for i in 0..60 {
        outcomes.record(&format!("bake-{i:02}"), &ok);
    }
    let page = |query: String| async move {
        request(addr, "GET", &format!("/api/history?{query}"), &[], "")
            .await
            .json()
    };
    let ids = |page: &Value| -> Vec<String> {
        page["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["job_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let first = page("limit=25".into()).await;
    assert_eq!(ids(&first)[0], "bake-59");
    assert_eq!(
        (first["matched"].as_u64(), first["newer"].as_u64()),
        (Some(60), Some(0))
    );
    let cursor = first["rows"][24]["seq"].as_u64().unwrap();
    let second = page(format!("limit=25&before={cursor}")).await;
    assert_eq!(ids(&second)[0], "bake-34");
    assert_eq!(second["newer"], 25);
    for i in 60..70 {
        outcomes.record(&format!("bake-{i:02}"), &ok);
    }
    let again = page(format!("limit=25&before={cursor}")).await;
    assert_eq!(ids(&again), ids(&second), "an older page stays put");
    assert_eq!(
        (again["matched"].as_u64(), again["newer"].as_u64()),
        (Some(70), Some(35))
    );
    let refused = request(addr, "GET", "/api/history?before=soon", &[], "").await;
    assert_eq!(refused.refused(400), "CONSOLE_BAD_REQUEST");
    console.shutdown().await.unwrap();
    sup.shutdown().await.unwrap();
}
