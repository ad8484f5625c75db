//! `EtcdBroker` against the broker conformance suite (`leasehold::conformance`), on a real etcd
//! started by the test on free loopback ports, reached through a proxy that can cut it off (to
//! make the broker lose a lease). Each check gets a broker on a pool of its own.
//!
//! Needs an etcd binary; without the binary the test
//! says SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it fails instead.

mod etcd_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_support::{Etcd, Proxy, etcd_binary, test_config};
use leasehold::conformance::Conformance;
use leasehold_etcd::EtcdBroker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_broker_passes_the_conformance_suite() {
    let Some(bin) = etcd_binary("the_etcd_broker_passes_the_conformance_suite") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Arc::new(Proxy::start(etcd.client_port()));
    let endpoint = proxy.endpoint();
    let pools = Arc::new(AtomicU64::new(0));
    let report = Conformance::new(move || {
        let endpoint = endpoint.clone();
        let pool = format!("conformance-{}", pools.fetch_add(1, Ordering::Relaxed));
        async move {
            // A short retry bound: a lease cut off from etcd is given up well before its TTL.
            let config = test_config(&endpoint, &pool, 2).retry_for(Duration::from_millis(800));
            EtcdBroker::connect(config)
                .await
                .expect("the broker connects")
        }
    })
    .lose_with(
        {
            let proxy = Arc::clone(&proxy);
            move |_, _| proxy.blackhole()
        },
        {
            let proxy = Arc::clone(&proxy);
            move |_| proxy.heal()
        },
    )
    .run()
    .await;
    println!("{report}");
    report.assert_passed();
    let skipped: Vec<_> = report.checks().iter().filter_map(|c| c.skipped()).collect();
    assert!(skipped.is_empty(), "every check applies to etcd: {report}");
}
