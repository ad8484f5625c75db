//! Checks the etcd test support itself: the etcd server fixture, the fault-injecting proxy and the
//! occupancy record.

mod etcd_support;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use etcd_support::{Etcd, OccupancyRecord, Proxy, etcd_binary, http_get, is_healthy_response};

const TIMEOUT: Duration = Duration::from_secs(5);

fn get_health(port: u16) -> String {
    http_get(port, "/health", TIMEOUT).unwrap_or_else(|e| panic!("GET /health on port {port}: {e}"))
}

/// A GET through `port` on a new connection must get no answer (not even a close) within 1 s.
fn assert_no_answer(port: u16) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to proxy");
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 1024];
    match stream.read(&mut buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        Ok(n) => panic!(
            "expected no answer, got {n} bytes: {:?}",
            String::from_utf8_lossy(&buf[..n])
        ),
        Err(e) => panic!("expected a read timeout, got {e}"),
    }
}

#[test]
fn etcd_starts_restarts_and_proxy_loses_answers() {
    let Some(bin) = etcd_binary("etcd_starts_restarts_and_proxy_loses_answers") else {
        return;
    };
    let mut etcd = Etcd::start(&bin);
    assert!(etcd.endpoint().starts_with("http://127.0.0.1:"));
    assert_eq!(
        etcd.endpoint(),
        format!("http://127.0.0.1:{}", etcd.client_port())
    );
    let health = get_health(etcd.client_port());
    assert!(is_healthy_response(&health), "unhealthy: {health}");
    assert!(etcd.data_dir().join("member").is_dir());

    // kill -9, then the same ports and data dir again.
    let first_pid = etcd.pid();
    etcd.kill9();
    assert!(!etcd.is_running());
    assert!(
        http_get(etcd.client_port(), "/health", Duration::from_secs(1)).is_err(),
        "etcd still answers after kill9"
    );
    etcd.restart();
    assert!(etcd.is_running());
    assert_ne!(etcd.pid(), first_pid);
    let health = get_health(etcd.client_port());
    assert!(
        is_healthy_response(&health),
        "unhealthy after restart: {health}"
    );
    assert!(
        etcd.log_tail().contains("restarting local member")
            || etcd.log_tail().contains("restarting member"),
        "restart did not reuse the data dir; log tail:\n{}",
        etcd.log_tail()
    );

    // The proxy forwards.
    let proxy = Proxy::start(etcd.client_port());
    assert_eq!(
        proxy.endpoint(),
        format!("http://127.0.0.1:{}", proxy.port())
    );
    let health = get_health(proxy.port());
    assert!(
        is_healthy_response(&health),
        "unhealthy through proxy: {health}"
    );
    assert_eq!(proxy.connections_accepted(), 1);

    // A connection opened before the fault, kept open across it.
    let mut old = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
    old.set_read_timeout(Some(TIMEOUT)).unwrap();

    // Lost answers: a new connection gets nothing back.
    proxy.drop_responses();
    assert_no_answer(proxy.port());
    assert_eq!(proxy.connections_accepted(), 3);

    // Heal closes the connection that lived through the fault, and new connections work.
    proxy.heal();
    let mut buf = [0u8; 16];
    assert_eq!(
        old.read(&mut buf).expect("old connection closed by heal"),
        0,
        "heal must close existing connections"
    );
    let health = get_health(proxy.port());
    assert!(
        is_healthy_response(&health),
        "unhealthy after heal: {health}"
    );

    // Black hole: nothing passes; heal again restores service.
    proxy.blackhole();
    assert_no_answer(proxy.port());
    proxy.heal();
    let health = get_health(proxy.port());
    assert!(
        is_healthy_response(&health),
        "unhealthy after second heal: {health}"
    );
    assert_eq!(proxy.connections_accepted(), 6);

    let proxy_port = proxy.port();
    drop(proxy);
    assert!(
        http_get(proxy_port, "/health", Duration::from_secs(1)).is_err(),
        "proxy still answers after drop"
    );

    let data_dir = etcd.data_dir();
    let pid = etcd.pid();
    drop(etcd);
    assert!(!data_dir.exists(), "data dir kept after drop");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "etcd process {pid} still exists after drop"
    );
}

#[test]
fn occupancy_record_counts_overlap() {
    let dir = tempfile::tempdir().unwrap();
    let record = OccupancyRecord::at(dir.path());
    assert_eq!(record.enter("a"), 1);
    assert_eq!(record.enter("b"), 2);
    assert_eq!(OccupancyRecord::holders_now(dir.path()), 2);
    record.leave("a");
    assert_eq!(OccupancyRecord::holders_now(dir.path()), 1);
    assert_eq!(record.enter("c"), 2);
    record.leave("b");
    record.leave("c");
    assert_eq!(OccupancyRecord::holders_now(dir.path()), 0);
    assert_eq!(OccupancyRecord::max_seen(dir.path()), 2);
    assert_eq!(OccupancyRecord::max_overlap(dir.path()), 2);

    // Strictly one after the other, from two records on the same dir: never more than one.
    let seq = tempfile::tempdir().unwrap();
    let first = OccupancyRecord::at(seq.path());
    let second = OccupancyRecord::at(seq.path());
    for i in 0..3 {
        assert_eq!(first.enter(&format!("x{i}")), 1);
        first.leave(&format!("x{i}"));
        assert_eq!(second.enter(&format!("y{i}")), 1);
        second.leave(&format!("y{i}"));
    }
    assert_eq!(OccupancyRecord::max_seen(seq.path()), 1);
    assert_eq!(OccupancyRecord::max_overlap(seq.path()), 1);
}

#[test]
fn occupancy_record_counts_across_threads() {
    let dir = tempfile::tempdir().unwrap();
    let record = std::sync::Arc::new(OccupancyRecord::at(dir.path()));
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let record = record.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                record.enter(&format!("t{i}"));
                barrier.wait();
                record.leave(&format!("t{i}"));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(OccupancyRecord::max_overlap(dir.path()), 4);
    assert_eq!(OccupancyRecord::max_seen(dir.path()), 4);
    assert_eq!(OccupancyRecord::holders_now(dir.path()), 0);
}

#[test]
#[should_panic(expected = "entered twice")]
fn occupancy_record_rejects_double_enter() {
    let dir = tempfile::tempdir().unwrap();
    let record = OccupancyRecord::at(dir.path());
    record.enter("a");
    record.enter("a");
}
