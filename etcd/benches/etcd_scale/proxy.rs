//! The bench's own delay proxy: one TCP listener in front of each etcd member, between every
//! client and that member (kernel netem is not available on these machines). Each chunk read
//! from either side is written to the other `delay` after it was read, in order; with no delay
//! it is written at once. Every byte is counted, per direction: the bytes on the wire.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Bytes moved so far, per direction.
#[derive(Debug, Default)]
pub struct Bytes {
    /// Client to member: requests.
    pub up: AtomicU64,
    /// Member to client: answers and watch events.
    pub down: AtomicU64,
}

/// A delay proxy in front of one member; stops accepting when dropped (connections already
/// open end when either side closes).
pub struct DelayProxy {
    addr: SocketAddr,
    bytes: Arc<Bytes>,
    stop: Arc<AtomicBool>,
}

impl DelayProxy {
    /// Starts a proxy to `target` on `rt`, delivering each chunk `delay` after it was read.
    pub fn start(rt: &tokio::runtime::Handle, target: SocketAddr, delay: Duration) -> DelayProxy {
        let listener = rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("bind the delay proxy");
        let addr = listener.local_addr().expect("the delay proxy's address");
        let bytes = Arc::new(Bytes::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (Arc::clone(&bytes), Arc::clone(&stop));
        rt.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let b = Arc::clone(&b);
                tokio::spawn(async move {
                    let Ok(member) = TcpStream::connect(target).await else {
                        return; // a killed member: the client sees its connection close
                    };
                    let _ = client.set_nodelay(true);
                    let _ = member.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (mr, mw) = member.into_split();
                    let up = tokio::spawn(pump(cr, mw, delay, Arc::clone(&b), true));
                    let down = tokio::spawn(pump(mr, cw, delay, b, false));
                    let _ = tokio::join!(up, down);
                });
            }
        });
        DelayProxy { addr, bytes, stop }
    }

    /// The URL clients connect to instead of the member's.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Bytes (up, down) moved so far.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.bytes.up.load(Ordering::Relaxed),
            self.bytes.down.load(Ordering::Relaxed),
        )
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees `stop`.
        let _ = std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Moves bytes from `from` to `to`: each chunk written `delay` after it was read, in order.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    bytes: Arc<Bytes>,
    up: bool,
) {
    let counter = if up { &bytes.up } else { &bytes.down };
    let mut buf = vec![0u8; 64 * 1024];
    if delay.is_zero() {
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0 || to.write_all(&buf[..n]).await.is_err() {
                break;
            }
            counter.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown().await;
        return;
    }
    // The writer runs on its own, so that reading goes on while earlier chunks wait out their
    // delay: every chunk is delivered `delay` after it was read, not after the one before it.
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        counter.fetch_add(n as u64, Ordering::Relaxed);
        if tx
            .send((Instant::now() + delay, buf[..n].to_vec()))
            .is_err()
        {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}
