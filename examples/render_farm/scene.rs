//! Scene files: a tiny `key = value` format, parsed by hand.
//!
//! ```text
//! # comment
//! name       = Seahorse valley        # free text
//! fractal    = mandelbrot             # or julia (then `c` is required)
//! center     = -0.7453, 0.1127        # the centre of the view
//! zoom       = 150                    # 1 shows a view 3.2 units wide
//! zoom_step  = 2                      # extra zoom per cycle when --jobs > scenes
//! iterations = 500
//! supersample = 2                     # 2 x 2 samples per pixel (1..=8)
//! palette    = ocean                  # see PALETTES
//! density    = 0.35                   # how fast the palette cycles
//! c          = -0.8, 0.156            # the Julia constant
//! formula    = csq(abs(z)) + c        # WGSL expression spliced into the shader
//! degree     = 2                      # the formula's degree (smooth colouring)
//! output     = 02-seahorse            # frame name (default: the file's stem)
//! ```

use std::fmt;

/// Cosine palettes (Inigo Quilez): colour(t) = a + b * cos(2π (c t + d)).
pub const PALETTES: &[(&str, [[f32; 3]; 4])] = &[
    ("rainbow", [[0.5; 3], [0.5; 3], [1.0; 3], [0.0, 0.33, 0.67]]),
    ("ocean", [[0.5; 3], [0.5; 3], [1.0; 3], [0.0, 0.10, 0.20]]),
    (
        "sunset",
        [[0.5; 3], [0.5; 3], [1.0, 0.7, 0.4], [0.0, 0.15, 0.20]],
    ),
    (
        "fire",
        [
            [0.6, 0.35, 0.15],
            [0.4, 0.35, 0.15],
            [1.0; 3],
            [0.5, 0.55, 0.60],
        ],
    ),
    (
        "electric",
        [[0.5; 3], [0.5; 3], [2.0, 1.0, 0.0], [0.5, 0.20, 0.25]],
    ),
    (
        "gold",
        [
            [0.8, 0.5, 0.4],
            [0.2, 0.4, 0.2],
            [2.0, 1.0, 1.0],
            [0.0, 0.25, 0.25],
        ],
    ),
    (
        "ice",
        [[0.5; 3], [0.5; 3], [1.0, 1.0, 0.5], [0.8, 0.90, 0.30]],
    ),
    ("candy", [[0.5; 3], [0.5; 3], [1.0; 3], [0.3, 0.20, 0.20]]),
];

/// Which set is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fractal {
    /// z starts at 0, c is the pixel.
    Mandelbrot,
    /// z starts at the pixel, c is fixed.
    Julia { c: [f32; 2] },
}

/// One parsed scene.
#[derive(Debug, Clone)]
pub struct Scene {
    pub name: String,
    pub fractal: Fractal,
    pub center: [f32; 2],
    pub zoom: f32,
    pub zoom_step: f32,
    pub iterations: u32,
    pub supersample: u32,
    pub palette: [[f32; 3]; 4],
    pub density: f32,
    /// `None`: the built-in `csq(z) + c`.
    pub formula: Option<String>,
    pub degree: f32,
    /// `None`: the file's stem.
    pub output: Option<String>,
}

/// Why a scene file was refused, with its line.
#[derive(Debug, Clone)]
pub struct SceneError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for SceneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}", self.message)
        } else {
            write!(f, "line {}: {}", self.line, self.message)
        }
    }
}

impl std::error::Error for SceneError {}

fn err(line: usize, message: impl Into<String>) -> SceneError {
    SceneError {
        line,
        message: message.into(),
    }
}

fn number(line: usize, key: &str, text: &str) -> Result<f32, SceneError> {
    text.trim()
        .parse::<f32>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| err(line, format!("{key}: `{}` is not a number", text.trim())))
}

fn pair(line: usize, key: &str, text: &str) -> Result<[f32; 2], SceneError> {
    let (x, y) = text.split_once(',').ok_or_else(|| {
        err(
            line,
            format!("{key}: expected `x, y`, got `{}`", text.trim()),
        )
    })?;
    Ok([number(line, key, x)?, number(line, key, y)?])
}

/// Parses a scene file's text.
pub fn parse(text: &str) -> Result<Scene, SceneError> {
    let mut name = None;
    let mut fractal = None;
    let mut center = [0.0, 0.0];
    let mut zoom = 1.0;
    let mut zoom_step = 2.0;
    let mut iterations = 256;
    let mut supersample = 1;
    let mut palette = PALETTES[0].1;
    let mut density = 0.35;
    let mut c = None;
    let mut formula = None;
    let mut degree = 2.0;
    let mut output = None;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        // `#` starts a comment, except inside a formula (WGSL has no `#`).
        let content = raw.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let (key, value) = content
            .split_once('=')
            .ok_or_else(|| err(line, format!("expected `key = value`, got `{content}`")))?;
        let (key, value) = (key.trim(), value.trim());
        if value.is_empty() {
            return Err(err(line, format!("{key}: empty value")));
        }
        match key {
            "name" => name = Some(value.to_string()),
            "fractal" => {
                fractal = Some(match value {
                    "mandelbrot" => "mandelbrot",
                    "julia" => "julia",
                    other => {
                        return Err(err(
                            line,
                            format!("fractal: `{other}` is neither mandelbrot nor julia"),
                        ));
                    }
                });
            }
            "center" => center = pair(line, key, value)?,
            "zoom" => zoom = number(line, key, value)?,
            "zoom_step" => zoom_step = number(line, key, value)?,
            "iterations" => {
                iterations = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=100_000).contains(n))
                    .ok_or_else(|| err(line, format!("iterations: `{value}` is not 1..=100000")))?;
            }
            "supersample" => {
                supersample = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=8).contains(n))
                    .ok_or_else(|| err(line, format!("supersample: `{value}` is not 1..=8")))?;
            }
            "palette" => {
                let (_, p) = PALETTES
                    .iter()
                    .find(|(n, _)| *n == value)
                    .ok_or_else(|| err(line, format!("palette: unknown palette `{value}`")))?;
                palette = *p;
            }
            "density" => density = number(line, key, value)?,
            "c" => c = Some(pair(line, key, value)?),
            "formula" => {
                // One expression only: it goes into `return <formula>;` in the shader.
                if value.contains([';', '{', '}']) {
                    return Err(err(
                        line,
                        "formula: one expression, without `;`, `{` or `}`",
                    ));
                }
                formula = Some(value.to_string());
            }
            "degree" => degree = number(line, key, value)?,
            "output" => {
                if !value
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_'))
                {
                    return Err(err(line, format!("output: `{value}` is not a plain name")));
                }
                output = Some(value.to_string());
            }
            other => return Err(err(line, format!("unknown key `{other}`"))),
        }
    }
    if zoom <= 0.0 || zoom_step <= 0.0 {
        return Err(err(0, "zoom and zoom_step must be positive"));
    }
    let fractal = match (fractal, c) {
        (Some("julia"), Some(c)) => Fractal::Julia { c },
        (Some("julia"), None) => return Err(err(0, "a julia scene needs `c = x, y`")),
        (Some(_), _) => Fractal::Mandelbrot,
        (None, _) => return Err(err(0, "missing `fractal = mandelbrot|julia`")),
    };
    Ok(Scene {
        name: name.ok_or_else(|| err(0, "missing `name = ...`"))?,
        fractal,
        center,
        zoom,
        zoom_step,
        iterations,
        supersample,
        palette,
        density,
        formula,
        degree,
        output,
    })
}
