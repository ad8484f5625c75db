//! The GPU side of a job: a compute shader that draws one fractal frame into the slot's scratch
//! buffer, read back and written as a PNG.

use std::fmt;
use std::num::NonZeroU64;
use std::path::Path;

use leasehold::wgpu::{self, PollType};
use leasehold::{CancellationToken, JobGpu};

use super::scene::{Fractal, Scene};

/// The shader; `{{FORMULA}}` is replaced by the scene's formula (default `csq(z) + c`).
const SHADER: &str = r#"
struct Params {
    view: vec4<f32>,    // centre x, centre y, units per pixel, bailout squared
    seed: vec4<f32>,    // julia c x, c y, 1 for julia, ln(degree)
    size: vec4<u32>,    // width, height, max iterations, samples per axis
    pal_a: vec4<f32>,   // palette a, density in w
    pal_b: vec4<f32>,
    pal_c: vec4<f32>,
    pal_d: vec4<f32>,
};

@group(0) @binding(0) var<storage, read_write> pixels: array<u32>;
@group(0) @binding(1) var<uniform> p: Params;

fn cmul(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    return vec2<f32>(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}
fn csq(a: vec2<f32>) -> vec2<f32> { return cmul(a, a); }
fn conj(a: vec2<f32>) -> vec2<f32> { return vec2<f32>(a.x, -a.y); }

fn next_z(z: vec2<f32>, c: vec2<f32>) -> vec2<f32> {
    return {{FORMULA}};
}

fn shade(pos: vec2<f32>) -> vec3<f32> {
    var z = vec2<f32>(0.0, 0.0);
    var c = pos;
    if (p.seed.z > 0.5) {
        z = pos;
        c = p.seed.xy;
    }
    var i = 0u;
    loop {
        if (i >= p.size.z || dot(z, z) > p.view.w) {
            break;
        }
        z = next_z(z, c);
        i = i + 1u;
    }
    if (i >= p.size.z) {
        return vec3<f32>(0.0, 0.0, 0.0);
    }
    // Smooth iteration count, then a cosine palette.
    let smooth_i = f32(i) + 1.0 - log(max(0.5 * log(dot(z, z)), 1e-6)) / p.seed.w;
    let t = sqrt(max(smooth_i, 0.0)) * p.pal_a.w;
    return p.pal_a.xyz + p.pal_b.xyz * cos(6.2831853 * (p.pal_c.xyz * t + p.pal_d.xyz));
}

@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= p.size.x || gid.y >= p.size.y) {
        return;
    }
    // n x n samples per pixel.
    let n = max(p.size.w, 1u);
    var rgb = vec3<f32>(0.0, 0.0, 0.0);
    for (var sy = 0u; sy < n; sy = sy + 1u) {
        for (var sx = 0u; sx < n; sx = sx + 1u) {
            let sub = (vec2<f32>(f32(sx), f32(sy)) + 0.5) / f32(n);
            let offset = vec2<f32>(
                f32(gid.x) + sub.x - 0.5 * f32(p.size.x),
                0.5 * f32(p.size.y) - f32(gid.y) - sub.y,
            );
            rgb = rgb + clamp(shade(p.view.xy + offset * p.view.z), vec3<f32>(0.0), vec3<f32>(1.0));
        }
    }
    let q = vec3<u32>(rgb / f32(n * n) * 255.0 + 0.5);
    pixels[gid.y * p.size.x + gid.x] = q.x | (q.y << 8u) | (q.z << 16u) | (255u << 24u);
}
"#;

/// How a frame's GPU part failed.
#[derive(Debug, Clone)]
pub struct GpuFailure(pub String);

impl fmt::Display for GpuFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The work of one frame, ready to run on a lease's GPU.
#[derive(Debug, Clone)]
pub struct Frame {
    pub width: u32,
    pub height: u32,
    pub scene: Scene,
    /// Extra zoom for this frame (zoom_step ^ cycle).
    pub zoom: f32,
}

impl Frame {
    fn bytes(&self) -> u64 {
        u64::from(self.width) * u64::from(self.height) * 4
    }

    fn params(&self) -> [u8; 112] {
        let s = &self.scene;
        let units_per_pixel = 3.2 / (s.zoom * self.zoom) / self.width as f32;
        let (julia, c) = match s.fractal {
            Fractal::Mandelbrot => (0.0, [0.0, 0.0]),
            Fractal::Julia { c } => (1.0, c),
        };
        let f = |v: [f32; 4]| v.map(f32::to_le_bytes).concat();
        let size = [self.width, self.height, s.iterations, s.supersample]
            .map(u32::to_le_bytes)
            .concat();
        let [a, b, cc, d] = s.palette;
        let out = [
            f([s.center[0], s.center[1], units_per_pixel, 65536.0]),
            f([c[0], c[1], julia, s.degree.max(1.01).ln()]),
            size,
            f([a[0], a[1], a[2], s.density]),
            f([b[0], b[1], b[2], 0.0]),
            f([cc[0], cc[1], cc[2], 0.0]),
            f([d[0], d[1], d[2], 0.0]),
        ]
        .concat();
        out.try_into().expect("7 x 16 bytes")
    }
}

/// Builds the pipeline inside a validation error scope, then submits the frame's dispatch and
/// the copy to the slot's readback buffer; `on_done` runs once the queue has completed it.
/// Runs on one thread (error scopes are per thread). `Ok(None)`: cancelled before submitting.
pub fn build_and_submit(
    gpu: &JobGpu,
    frame: &Frame,
    cancel: &CancellationToken,
    on_done: impl FnOnce() + Send + 'static,
) -> Result<Option<wgpu::SubmissionIndex>, GpuFailure> {
    let device = gpu.device();
    let source = SHADER.replace(
        "{{FORMULA}}",
        frame.scene.formula.as_deref().unwrap_or("csq(z) + c"),
    );
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("fractal"),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("fractal"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    // On native backends the scope's future is ready at once; block_on is fine on the
    // blocking pool.
    if let Some(error) = tokio::runtime::Handle::current().block_on(scope.pop()) {
        return Err(GpuFailure(compact(&error.to_string())));
    }
    let params = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("fractal params"),
        size: 112,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    gpu.queue().write_buffer(&params, 0, &frame.params());
    let scratch = gpu.scratch();
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("fractal"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &scratch.storage,
                    offset: 0,
                    size: NonZeroU64::new(frame.bytes()),
                }),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: params.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(frame.width.div_ceil(8), frame.height.div_ceil(8), 1);
    }
    encoder.copy_buffer_to_buffer(&scratch.storage, 0, &scratch.readback, 0, frame.bytes());
    if cancel.is_cancelled() {
        return Ok(None);
    }
    let index = gpu.submit([encoder.finish()]);
    gpu.queue().on_submitted_work_done(on_done);
    Ok(Some(index))
}

/// Waits (on the blocking pool) until the GPU has completed the submission.
///
/// An untimed wait on purpose: in wgpu-core 30, a `PollType::Wait` that times out while another
/// thread polls or submits on the same device can trip an internal assertion ("If the queue is
/// empty, the current submission index ... should be at least the wait submission index").
pub fn wait_for(gpu: &JobGpu, index: wgpu::SubmissionIndex) -> Result<(), GpuFailure> {
    gpu.device()
        .poll(PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        })
        .map(|_| ())
        .map_err(|e| GpuFailure(e.to_string()))
}

/// Maps the slot's readback buffer (the GPU work is complete), encodes the PNG to `tmp` and
/// moves it to `dest`.
pub fn read_back_and_write(
    gpu: &JobGpu,
    frame: &Frame,
    tmp: &Path,
    dest: &Path,
) -> Result<u64, GpuFailure> {
    let readback = &gpu.scratch().readback;
    let n = frame.bytes();
    let (tx, rx) = std::sync::mpsc::channel();
    readback.map_async(wgpu::MapMode::Read, 0..n, move |r| {
        let _ = tx.send(r);
    });
    gpu.device()
        .poll(PollType::wait_indefinitely())
        .map_err(|e| GpuFailure(e.to_string()))?;
    rx.recv()
        .map_err(|e| GpuFailure(e.to_string()))?
        .map_err(|e| GpuFailure(format!("map readback: {e}")))?;
    let rgba = readback
        .get_mapped_range(0..n)
        .map_err(|e| GpuFailure(format!("mapped range: {e}")))?
        .to_vec();
    readback.unmap();
    write_png(tmp, frame.width, frame.height, png::ColorType::Rgba, &rgba)
        .map_err(|e| GpuFailure(format!("png: {e}")))?;
    std::fs::rename(tmp, dest).map_err(|e| GpuFailure(format!("publish frame: {e}")))?;
    Ok(n)
}

/// Writes 8-bit pixels as a PNG file.
pub fn write_png(
    path: &Path,
    width: u32,
    height: u32,
    color: png::ColorType,
    pixels: &[u8],
) -> std::io::Result<()> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, width, height);
    encoder.set_color(color);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(std::io::Error::other)?;
    writer
        .write_image_data(pixels)
        .map_err(std::io::Error::other)?;
    writer.finish().map_err(std::io::Error::other)
}

/// The gist of a wgpu/naga error on one line: its `error:` line, else its first lines.
fn compact(message: &str) -> String {
    let lines: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    match lines.iter().find(|l| l.contains("error:")) {
        Some(line) => line.to_string(),
        None => lines.into_iter().take(3).collect::<Vec<_>>().join(" | "),
    }
}
