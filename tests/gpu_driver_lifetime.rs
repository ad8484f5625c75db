//! The Vulkan driver stays loaded after a supervisor's last device is gone.
//!
//! On NVIDIA's driver (580, seen on an H200), a process crashed with SIGSEGV when a thread that
//! had called into the driver ended after the last device and instance were dropped: the Vulkan
//! loader had unloaded the driver's library, whose thread-exit destructors were still
//! registered. leasehold keeps one Vulkan instance for the life of the process, so the loader
//! keeps every driver it loaded. Mesa's lavapipe (CI) is unloaded the same way without it, so
//! this test shows the driver library still mapped after the shutdown, by `/proc/self/maps`.
//!
//! Its own test binary: a device another test held would keep the driver loaded anyway.
#![cfg(all(feature = "gpu", target_os = "linux"))]

mod gpu_support;

use std::collections::BTreeSet;
use std::io::Write;

use gpu_support::{REQUIRE_GPU_ENV, read_back};
use leasehold::{GpuError, GpuOptions, JobSpec, StartError, Supervisor, wgpu};

/// Paths of the shared libraries mapped into this process.
fn mapped_libraries() -> BTreeSet<String> {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.contains(".so"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vulkan_driver_stays_loaded_after_the_last_device_is_dropped() {
    let before = mapped_libraries();
    // Vulkan alone, whatever `WGPU_BACKEND` says: what the instance loads is then the Vulkan
    // loader, the drivers and their dependencies (a GL instance loads and unloads its own).
    let started = Supervisor::builder()
        .gpu(GpuOptions::new().backends(wgpu::Backends::VULKAN))
        .start()
        .await;
    let sup = match started {
        Ok(sup) => sup,
        Err(StartError::Gpu(GpuError::NoAdapter)) => {
            let forced = std::env::var("WGPU_BACKEND").ok();
            assert!(
                std::env::var(REQUIRE_GPU_ENV).as_deref() != Ok("1")
                    || forced.as_deref().is_some_and(|b| !b.contains("vulkan")),
                "{REQUIRE_GPU_ENV}=1 but no Vulkan adapter was found: install mesa-vulkan-drivers \
                 libvulkan1"
            );
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIPPED: no Vulkan adapter on this machine (WGPU_BACKEND={forced:?}): \
                 the_vulkan_driver_stays_loaded_after_the_last_device_is_dropped passes without \
                 running. Install mesa-vulkan-drivers libvulkan1 ***\n"
            );
            return;
        }
        Err(e) => panic!("could not start on a Vulkan GPU: {e:?}"),
    };
    sup.run(JobSpec::new("use-the-driver").unwrap(), |ctx| async move {
        let gpu = ctx.gpu().unwrap().clone();
        assert_eq!(gpu.adapter_info().backend, wgpu::Backend::Vulkan);
        ctx.spawn_blocking(move || read_back(&gpu, 4))
            .await
            .map_err(std::io::Error::other)
    })
    .await
    .unwrap();
    let loaded: BTreeSet<String> = mapped_libraries().difference(&before).cloned().collect();
    assert!(
        loaded.iter().any(|l| l.contains("libvulkan")),
        "no Vulkan library was loaded for the device: {loaded:#?}"
    );

    let report = sup.shutdown().await.unwrap();
    assert!(report.unclosed_devices.is_empty(), "{report:?}");
    drop(sup);

    let after = mapped_libraries();
    let unloaded: Vec<_> = loaded.difference(&after).collect();
    assert!(
        unloaded.is_empty(),
        "libraries the device loaded were unloaded after its shutdown: {unloaded:#?}"
    );
}
