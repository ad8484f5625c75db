//! GPU test support: starting a supervisor on whatever adapter the machine has (or saying
//! loudly why not), a test shader, and helpers to dispatch and read back.
//!
//! `WGPU_BACKEND` (read by `GpuOptions::new`) picks the backend: CI runs the GPU suites once
//! as they come (Vulkan, lavapipe) and once with `WGPU_BACKEND=gl` (GL on EGL, llvmpipe).
#![allow(dead_code, unreachable_pub)]

use std::io::Write;
use std::sync::Once;

use leasehold::{
    GpuError, GpuOptions, JobError, JobGpu, JobSpec, StartError, Supervisor, SupervisorBuilder,
    wgpu,
};

pub const SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;

// About 250 ms on lavapipe with 1024 x 64 invocations.
@compute @workgroup_size(64)
fn long(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < 20000u; i = i + 1u) {
        x = x * 1664525u + 1013904223u;
    }
    data[gid.x + 1u] = x;
}

@compute @workgroup_size(64)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>) {
    data[gid.x] = gid.x * 2u + 1u;
}
"#;

/// Set to `1` (CI does) to make a missing adapter a failure instead of a skip.
pub const REQUIRE_GPU_ENV: &str = "LEASEHOLD_REQUIRE_GPU";

/// Starts a supervisor on a GPU, or says loudly why it cannot (a failure under
/// `LEASEHOLD_REQUIRE_GPU=1`).
pub async fn start(builder: SupervisorBuilder, opts: GpuOptions) -> Option<Supervisor> {
    match builder.gpu(opts).start().await {
        Ok(sup) => Some(sup),
        Err(StartError::Gpu(GpuError::NoAdapter)) => {
            assert_ne!(
                std::env::var(REQUIRE_GPU_ENV).as_deref(),
                Ok("1"),
                "{REQUIRE_GPU_ENV}=1 but no GPU adapter was found (WGPU_BACKEND={:?}): install \
                 Mesa (libegl1 libgl1-mesa-dri for GL, mesa-vulkan-drivers libvulkan1 for Vulkan)",
                std::env::var("WGPU_BACKEND").ok()
            );
            say_skipped();
            None
        }
        Err(e) => panic!("could not start on a GPU: {e:?}"),
    }
}

/// Says, once per test binary, that its GPU tests pass without running. Written to the process's
/// stderr directly: libtest captures what `eprintln!` prints in a passing test, and a skip must
/// be seen.
fn say_skipped() {
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        let _ = writeln!(
            std::io::stderr(),
            "\n*** SKIPPED: no GPU adapter on this machine (WGPU_BACKEND={:?}): the GPU tests of \
             {} pass without running. Install Mesa: libegl1 libgl1-mesa-dri (GL) or \
             mesa-vulkan-drivers libvulkan1 (Vulkan) ***\n",
            std::env::var("WGPU_BACKEND").ok(),
            std::env::args()
                .next()
                .and_then(|p| std::path::Path::new(&p)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_default(),
        );
    });
}

/// One compute dispatch of `entry` over the job's scratch storage buffer.
pub fn dispatch(gpu: &JobGpu, entry: &str, groups: u32) -> wgpu::CommandBuffer {
    let device = gpu.device();
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("test"),
        source: wgpu::ShaderSource::Wgsl(SHADER.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: gpu.scratch().storage.as_entire_binding(),
        }],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(groups, 1, 1);
    }
    encoder.finish()
}

/// Maps the first `n` words of the slot's readback buffer as they are (after every submission
/// so far), reads them and unmaps.
pub fn map_readback(gpu: &JobGpu, n: u64) -> Vec<u32> {
    let readback = &gpu.scratch().readback;
    readback.map_async(wgpu::MapMode::Read, 0..n * 4, |r| r.unwrap());
    gpu.device()
        .poll(wgpu::PollType::wait_indefinitely())
        .unwrap();
    let words = {
        let view = readback.get_mapped_range(0..n * 4).unwrap();
        view.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    readback.unmap();
    words
}

/// Copies the first `n` words of the slot's scratch storage to its readback buffer and reads
/// them.
pub fn read_back(gpu: &JobGpu, n: u64) -> Vec<u32> {
    let scratch = gpu.scratch();
    let mut encoder = gpu.device().create_command_encoder(&Default::default());
    encoder.copy_buffer_to_buffer(&scratch.storage, 0, &scratch.readback, 0, n * 4);
    gpu.submit([encoder.finish()]);
    map_readback(gpu, n)
}

/// Dispatches `fill` and reads the first 4 words of the scratch back (`[1, 3, 5, 7]` on a
/// working device).
pub fn fill_and_read(gpu: &JobGpu) -> Vec<u32> {
    gpu.submit([dispatch(gpu, "fill", 1)]);
    read_back(gpu, 4)
}

/// A job that fills the first 4 words of its scratch on the GPU and reads them back, off the
/// async runtime (the read back blocks).
pub async fn fill_job(sup: &Supervisor, id: &str) -> Result<Vec<u32>, JobError<std::io::Error>> {
    sup.run(JobSpec::new(id).unwrap(), |ctx| async move {
        let gpu = ctx.gpu().expect("a gpu slot").clone();
        let words = ctx
            .spawn_blocking(move || fill_and_read(&gpu))
            .await
            .unwrap();
        Ok::<_, std::io::Error>(words)
    })
    .await
}

/// The `n`-word pattern a job writes to show what the next lease can see.
pub fn pattern(n: u64) -> Vec<u32> {
    (0..n as u32).map(|i| 0xC0DE_0000 | i).collect()
}

pub fn bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// A device the test creates itself, as an engine would (for `GpuOptions::adopt`): on the
/// backends `WGPU_BACKEND` names, software adapters accepted. `None` (said loudly, a failure
/// under `LEASEHOLD_REQUIRE_GPU=1`) when there is no adapter.
///
/// Without `WGPU_BACKEND`, Vulkan alone first, and GL in an instance of its own only when
/// Vulkan has no adapter: a device on an instance that also holds GL tears EGL down when it is
/// dropped, which hung beside another thread's `vkDestroyDevice` on NVIDIA's driver.
pub async fn engine_device() -> Option<(wgpu::Device, wgpu::Queue, wgpu::AdapterInfo)> {
    engine_device_limited(wgpu::Limits::default()).await
}

/// [`engine_device`] with `limits` (at most the adapter's).
pub async fn engine_device_limited(
    limits: wgpu::Limits,
) -> Option<(wgpu::Device, wgpu::Queue, wgpu::AdapterInfo)> {
    if let Some(named) = wgpu::Backends::from_env() {
        return engine_device_with(named, limits).await;
    }
    match adapter_on(wgpu::Backends::VULKAN).await {
        Ok(adapter) => Some(device_on(adapter, limits).await),
        Err(_) => engine_device_with(wgpu::Backends::GL, limits).await,
    }
}

async fn adapter_on(backends: wgpu::Backends) -> Result<wgpu::Adapter, wgpu::RequestAdapterError> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    wgpu::Instance::new(desc)
        .request_adapter(&wgpu::RequestAdapterOptions::default())
        .await
}

async fn device_on(
    adapter: wgpu::Adapter,
    limits: wgpu::Limits,
) -> (wgpu::Device, wgpu::Queue, wgpu::AdapterInfo) {
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("engine"),
            required_limits: limits,
            ..Default::default()
        })
        .await
        .expect("the engine's device");
    (device, queue, adapter.get_info())
}

/// [`engine_device`] on `backends`, with `limits` (at most the adapter's).
pub async fn engine_device_with(
    backends: wgpu::Backends,
    limits: wgpu::Limits,
) -> Option<(wgpu::Device, wgpu::Queue, wgpu::AdapterInfo)> {
    let adapter = match adapter_on(backends).await {
        Ok(adapter) => adapter,
        Err(e) => {
            assert_ne!(
                std::env::var(REQUIRE_GPU_ENV).as_deref(),
                Ok("1"),
                "{REQUIRE_GPU_ENV}=1 but no GPU adapter was found for the engine's device \
                 (WGPU_BACKEND={:?}): {e}",
                std::env::var("WGPU_BACKEND").ok()
            );
            say_skipped();
            return None;
        }
    };
    Some(device_on(adapter, limits).await)
}
