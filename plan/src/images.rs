//! Image folders: one subfolder per class, as torchvision's `ImageFolder` lays them out
//! (classes numbered in the order of their folder names, images in the order of theirs),
//! PNG or JPEG files decoded, resized so the shorter side is `resize`, centre-cropped to the
//! model's [channels, height, width] input and normalised per channel,
//! `(value / 255 − mean) / std`. The executor loads them for training and `pipec check`
//! reads the first ones with the same code.

use std::path::{Path, PathBuf};

use crate::datafile::{Expect, Extent, Samples};

/// What a spec says about its images.
#[derive(Debug, Clone, PartialEq)]
pub struct Transform {
    /// The shorter side after resizing, before the centre crop (None: the crop's longer side,
    /// so the whole shorter side is kept).
    pub resize: Option<usize>,
    /// Per channel; empty: 0.
    pub mean: Vec<f64>,
    /// Per channel; empty: 1.
    pub std: Vec<f64>,
}

/// How many times the crop's longer side a `resize` may be: a shorter side 8 times the
/// crop's keeps under 1/64 of the image, which no recipe wants.
pub const MAX_RESIZE_FACTOR: usize = 8;

/// The most bytes one image may take while it is resized (before the centre crop): a
/// gibibyte, or an eighth of the memory this machine has available if that is less —
/// `pipec check`, the editor and every data loader of a run decode images at once.
pub fn transform_budget() -> u64 {
    let gib = 1u64 << 30;
    available_memory().map_or(gib, |a| gib.min(a / 8))
}

/// The memory this machine has available (Linux's `MemAvailable`), when it says.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What is wrong with resizing images' shorter side to `resize` for a model's [channels,
/// height, width] input (None: nothing): at most [`MAX_RESIZE_FACTOR`] times the crop's
/// longer side, and a square image so resized within [`transform_budget`].
pub fn resize_problem(resize: usize, [c, h, w]: [usize; 3]) -> Option<String> {
    let most = MAX_RESIZE_FACTOR * h.max(w);
    if resize > most {
        return Some(format!(
            "more than {MAX_RESIZE_FACTOR} times the crop's longer side ({most} for a {h}×{w} input), so the crop would keep under 1/{} of each image",
            MAX_RESIZE_FACTOR * MAX_RESIZE_FACTOR
        ));
    }
    let bytes = (resize as u64).saturating_mul(resize as u64).saturating_mul(c.max(1) as u64);
    let budget = transform_budget();
    (bytes > budget).then(|| {
        format!(
            "a square image resized to it takes {} MiB, more than the {} MiB an image may take while it is decoded here",
            bytes >> 20,
            budget >> 20
        )
    })
}

/// A folder's classes by name, in label order, each with its image files in order.
pub fn scan(dir: &Path) -> Result<Vec<(String, Vec<PathBuf>)>, String> {
    let shown = dir.display();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot read the image folder `{shown}`: {e}"))?;
    let mut classes: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(name, _)| !name.starts_with('.'))
        .collect();
    classes.sort();
    if classes.is_empty() {
        return Err(format!(
            "the image folder `{shown}` has no class folders: put each class's images in a folder of its own (`{shown}/cat/1.png`)"
        ));
    }
    let mut out = Vec::with_capacity(classes.len());
    let mut empty = Vec::new();
    for (name, path) in classes {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file() && is_image(p))
            .collect();
        files.sort();
        if files.is_empty() {
            empty.push(name.clone());
        }
        out.push((name, files));
    }
    if !empty.is_empty() {
        return Err(format!(
            "class folder(s) with no PNG or JPEG image in `{shown}`: {} (a class the data never shows cannot be learned)",
            empty.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(out)
}

fn is_image(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| matches!(e.to_ascii_lowercase().as_str(), "png" | "jpg" | "jpeg"))
}

/// One image file as a model's [channels, height, width] input, row-major.
pub fn decode(path: &Path, shape: [usize; 3], t: &Transform) -> Result<Vec<f32>, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
    decode_bytes(&bytes, &shown.to_string(), shape, t)
}

/// [`decode`] on an image file's bytes (`shown` names it in errors). Decoding is bounded by
/// the `image` crate's limits (512 MiB per image), the resize by [`transform_budget`].
pub fn decode_bytes(bytes: &[u8], shown: &str, shape: [usize; 3], t: &Transform) -> Result<Vec<f32>, String> {
    let img = image::load_from_memory(bytes).map_err(|e| format!("`{shown}` is not a readable image: {e}"))?;
    transform(&img, shown, shape, t)
}

/// A decoded image through the spec's transform: resized, centre-cropped, normalised.
fn transform(img: &image::DynamicImage, shown: &str, shape: [usize; 3], t: &Transform) -> Result<Vec<f32>, String> {
    let [c, h, w] = shape;
    let have = img.color().channel_count();
    // colour needs three channels (an alpha channel is dropped), grey one
    let fits = match c {
        3 => have >= 3,
        1 => have <= 2,
        _ => false,
    };
    if !fits {
        let kind = if have <= 2 { "greyscale" } else { "colour" };
        return Err(format!("`{shown}` is a {kind} image ({have} channel(s)) and the model takes {c} channel(s)"));
    }
    let (iw, ih) = (img.width() as usize, img.height() as usize);
    if iw == 0 || ih == 0 {
        return Err(format!("`{shown}` is empty"));
    }
    let short = t.resize.unwrap_or(h.max(w)).max(1);
    // the shorter side to `short`, the other in proportion (at least the crop)
    let scale = short as f64 / iw.min(ih) as f64;
    let (rw, rh) = (((iw as f64 * scale).round() as usize).max(w), ((ih as f64 * scale).round() as usize).max(h));
    // bounded before it is allocated: a long panorama resized by its shorter side grows too
    let bytes = (rw as u64).saturating_mul(rh as u64).saturating_mul(c as u64);
    if bytes > transform_budget() {
        return Err(format!(
            "`{shown}` ({iw}×{ih}) resized to {rw}×{rh} would take {} MiB, more than the {} MiB an image may take while it is transformed; lower `resize`",
            bytes >> 20,
            transform_budget() >> 20
        ));
    }
    let filter = image::imageops::FilterType::Triangle;
    let resized = img.resize_exact(rw as u32, rh as u32, filter);
    let (x0, y0) = ((rw - w) / 2, (rh - h) / 2);
    let mut out = vec![0.0f32; c * h * w];
    let channel = |k: usize, v: f64| {
        let m = t.mean.get(k).copied().unwrap_or(0.0);
        let s = t.std.get(k).copied().unwrap_or(1.0);
        ((v / 255.0 - m) / s) as f32
    };
    if c == 3 {
        let rgb = resized.to_rgb8();
        for y in 0..h {
            for x in 0..w {
                let p = rgb.get_pixel((x0 + x) as u32, (y0 + y) as u32);
                for k in 0..3 {
                    out[k * h * w + y * w + x] = channel(k, f64::from(p[k]));
                }
            }
        }
    } else {
        let grey = resized.to_luma8();
        for y in 0..h {
            for x in 0..w {
                out[y * w + x] = channel(0, f64::from(grey.get_pixel((x0 + x) as u32, (y0 + y) as u32)[0]));
            }
        }
    }
    Ok(out)
}

/// CIFAR-10's binary format: records of one label byte and a 32×32 RGB image, its red,
/// green and blue planes one after the other.
const CIFAR_RECORD: usize = 1 + 3 * 32 * 32;

/// A CIFAR-10 batch file (`data_batch_1.bin`) as samples, each image through the transform.
fn load_cifar(
    path: &Path,
    shape: [usize; 3],
    classes: usize,
    t: &Transform,
    extent: Extent,
) -> Result<Samples, String> {
    let shown = path.display();
    let mut bytes = std::fs::read(path).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
    if bytes.is_empty() || bytes.len() % CIFAR_RECORD != 0 {
        return Err(format!(
            "`{shown}` is not a CIFAR-10 batch file: {} bytes is not a whole number of {CIFAR_RECORD}-byte records (a label byte and a 32×32 RGB image)",
            bytes.len()
        ));
    }
    if let Extent::Prefix(n) = extent {
        bytes.truncate((n as usize / CIFAR_RECORD).max(1) * CIFAR_RECORD);
    }
    if shape[0] != 3 {
        return Err(format!("CIFAR-10's images have 3 channels and the model takes {}", shape[0]));
    }
    let mut inputs = Vec::new();
    let mut targets = Vec::new();
    for (k, r) in bytes.chunks_exact(CIFAR_RECORD).enumerate() {
        let label = usize::from(r[0]);
        if label >= classes {
            return Err(format!("`{shown}`: record {k} has label {label}, and the model scores {classes} classes"));
        }
        let pixels = &r[1..];
        let img = image::RgbImage::from_fn(32, 32, |x, y| {
            let i = (y * 32 + x) as usize;
            image::Rgb([pixels[i], pixels[1024 + i], pixels[2048 + i]])
        });
        let one = transform(&image::DynamicImage::ImageRgb8(img), &format!("{shown} (record {k})"), shape, t)?;
        inputs.extend(one.into_iter().map(f64::from));
        targets.push(label as f64);
    }
    let samples = targets.len();
    Ok(Samples { inputs, targets, samples })
}

/// A folder's images (or a CIFAR-10 batch file's) as a classifier's samples: inputs of the
/// model's shape, targets the class index. With `Extent::Prefix(n)` (`pipec check`), the
/// images up to `n` bytes of files, taken from every class in turn.
pub fn load_folder(
    dir: &Path,
    input: &[usize],
    expect: &Expect,
    t: &Transform,
    extent: Extent,
) -> Result<Samples, String> {
    let &[c, h, w] = input else {
        return Err(format!("image data needs a [channels, height, width] input, and the model takes {input:?}"));
    };
    let Some(classes) = expect.classes else {
        return Err(
            "image folders are a classifier's data (their labels are class indices): use `loss: cross_entropy`".into(),
        );
    };
    if expect.positions != 1 {
        return Err("image folders give one class per image, and the model predicts one per position".into());
    }
    for (what, v) in [("mean", &t.mean), ("std", &t.std)] {
        if !v.is_empty() && v.len() != c {
            return Err(format!("`{what}` has {} value(s) and the images {c} channel(s)", v.len()));
        }
    }
    if t.std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return Err("every `std` must be positive".into());
    }
    if dir.is_file() {
        return load_cifar(dir, [c, h, w], classes, t, extent);
    }
    let found = scan(dir)?;
    if found.len() != classes {
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).take(8).collect();
        return Err(format!(
            "`{}` has {} class folder(s) ({}{}) and the model scores {classes} classes",
            dir.display(),
            found.len(),
            names.join(", "),
            if found.len() > names.len() { ", ..." } else { "" }
        ));
    }
    // in label order, or (a check) round robin over the classes up to the byte budget
    let mut order: Vec<(usize, &PathBuf)> = Vec::new();
    match extent {
        Extent::All => {
            for (label, (_, files)) in found.iter().enumerate() {
                order.extend(files.iter().map(|f| (label, f)));
            }
        }
        Extent::Prefix(budget) => {
            let mut spent = 0u64;
            let longest = found.iter().map(|(_, f)| f.len()).max().unwrap_or(0);
            'all: for i in 0..longest {
                for (label, (_, files)) in found.iter().enumerate() {
                    if let Some(f) = files.get(i) {
                        if spent >= budget {
                            break 'all;
                        }
                        spent += std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
                        order.push((label, f));
                    }
                }
            }
        }
    }
    let mut inputs = Vec::with_capacity(order.len() * c * h * w);
    let mut targets = Vec::with_capacity(order.len());
    for (label, f) in &order {
        inputs.extend(decode(f, [c, h, w], t)?.into_iter().map(f64::from));
        targets.push(*label as f64);
    }
    Ok(Samples { inputs, targets, samples: order.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resize_is_bounded_before_anything_is_allocated() {
        // against the crop: at most 8 times its longer side
        assert!(resize_problem(256, [3, 224, 224]).is_none());
        assert!(resize_problem(100_000, [3, 224, 224]).expect("too large").contains("8 times the crop's longer side"));
        // a square image so resized must fit the budget
        let side = ((transform_budget() / 3) as f64).sqrt() as usize + 1;
        let e = resize_problem(side, [3, side, side]).expect("over the budget");
        assert!(e.contains("MiB, more than the"), "{e}");
        // a long panorama resized by its shorter side grows past the budget: refused at
        // decode, before the resize allocates
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("panorama.png");
        let budget = transform_budget() as f64;
        let wide = (budget / (3.0 * 512.0 * 512.0)).ceil() as u32 * 2 + 1;
        png(&path, wide, 1, false, |_, _| [9, 9, 9]);
        let t = Transform { resize: Some(512), mean: vec![], std: vec![] };
        let e = decode(&path, [3, 64, 64], &t).expect_err("too large once resized");
        assert!(e.contains("panorama.png") && e.contains("would take"), "{e}");
    }

    fn png(path: &Path, w: u32, h: u32, grey: bool, f: impl Fn(u32, u32) -> [u8; 3]) {
        if grey {
            image::GrayImage::from_fn(w, h, |x, y| image::Luma([f(x, y)[0]])).save(path).expect("png");
        } else {
            image::RgbImage::from_fn(w, h, |x, y| image::Rgb(f(x, y))).save(path).expect("png");
        }
    }

    #[test]
    fn a_folder_is_classes_in_name_order_cropped_and_normalised() {
        let dir = tempfile::tempdir().expect("tmp");
        for (class, colour) in [("b-green", [0u8, 255, 0]), ("a-red", [255, 0, 0])] {
            std::fs::create_dir(dir.path().join(class)).expect("dir");
            for i in 0..3 {
                png(&dir.path().join(class).join(format!("{i}.png")), 12, 8, false, |_, _| colour);
            }
        }
        let expect = Expect { numel: 3 * 4 * 4, classes: Some(2), outputs: 2, vocab: None, positions: 1 };
        let t = Transform { resize: None, mean: vec![0.5; 3], std: vec![0.5; 3] };
        let s = load_folder(dir.path(), &[3, 4, 4], &expect, &t, Extent::All).expect("loads");
        assert_eq!(s.samples, 6);
        // `a-red` is class 0: its images first, red channel (1 − 0.5)/0.5 = 1, others −1
        assert_eq!(s.targets, vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(&s.inputs[..16], &[1.0; 16]);
        assert_eq!(&s.inputs[16..32], &[-1.0; 16]);
        // the centre crop of a left-half-black image resized to 4 rows: the crop's columns
        // come from the middle
        let grad = dir.path().join("x.png");
        png(&grad, 16, 8, false, |x, _| if x < 8 { [0, 0, 0] } else { [255, 255, 255] });
        let v = decode(&grad, [3, 4, 4], &Transform { resize: Some(4), mean: vec![], std: vec![] }).expect("decodes");
        assert!(v[0] < 0.5 && v[3] > 0.5, "{:?}", &v[..4]);
        // JPEG too (lossy: near the colour written), and greyscale into a 1-channel input
        let jpg = dir.path().join("x.jpg");
        image::RgbImage::from_fn(8, 8, |_, _| image::Rgb([200, 40, 40])).save(&jpg).expect("jpeg");
        let v = decode(&jpg, [3, 4, 4], &Transform { resize: None, mean: vec![], std: vec![] }).expect("decodes");
        assert!((v[0] - 200.0 / 255.0).abs() < 0.05 && (v[16] - 40.0 / 255.0).abs() < 0.05, "{:?}", (v[0], v[16]));
        let grey = dir.path().join("g.png");
        png(&grey, 4, 4, true, |_, _| [51, 0, 0]);
        assert_eq!(decode(&grey, [1, 4, 4], &Transform { resize: None, mean: vec![], std: vec![] }), Ok(vec![0.2; 16]));
    }

    #[test]
    fn a_cifar10_batch_file_is_labels_and_rgb_planes() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut bytes = Vec::new();
        for (label, rgb) in [(2u8, [255u8, 0, 0]), (0, [0, 0, 255]), (9, [0, 255, 0])] {
            bytes.push(label);
            for v in rgb {
                bytes.extend(std::iter::repeat_n(v, 1024));
            }
        }
        let path = dir.path().join("data_batch_1.bin");
        std::fs::write(&path, &bytes).expect("w");
        let expect = Expect { numel: 3 * 32 * 32, classes: Some(10), outputs: 10, vocab: None, positions: 1 };
        let t = Transform { resize: None, mean: vec![], std: vec![] };
        let s = load_folder(&path, &[3, 32, 32], &expect, &t, Extent::All).expect("loads");
        assert_eq!((s.samples, s.targets.clone()), (3, vec![2.0, 0.0, 9.0]));
        let plane = 32 * 32;
        // the first image is red: its red plane 1, its green and blue planes 0
        assert_eq!((s.inputs[0], s.inputs[plane], s.inputs[2 * plane]), (1.0, 0.0, 0.0));
        // the second is blue
        assert_eq!(s.inputs[3 * plane + 2 * plane], 1.0);
        let e = load_folder(&path, &[3, 32, 32], &Expect { classes: Some(5), ..expect }, &t, Extent::All)
            .expect_err("label 9");
        assert!(e.contains("record 2 has label 9"), "{e}");
        std::fs::write(&path, &bytes[..100]).expect("w");
        let e = load_folder(&path, &[3, 32, 32], &expect, &t, Extent::All).expect_err("size");
        assert!(e.contains("not a CIFAR-10 batch file"), "{e}");
    }

    #[test]
    fn bad_folders_say_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tmp");
        let expect = Expect { numel: 3 * 4 * 4, classes: Some(2), outputs: 2, vocab: None, positions: 1 };
        let t = Transform { resize: None, mean: vec![], std: vec![] };
        let e = load_folder(dir.path(), &[3, 4, 4], &expect, &t, Extent::All).expect_err("no classes");
        assert!(e.contains("no class folders"), "{e}");
        std::fs::create_dir(dir.path().join("cat")).expect("dir");
        std::fs::create_dir(dir.path().join("dog")).expect("dir");
        png(&dir.path().join("cat/1.png"), 4, 4, false, |_, _| [1, 2, 3]);
        let e = load_folder(dir.path(), &[3, 4, 4], &expect, &t, Extent::All).expect_err("empty class");
        assert!(e.contains("`dog`"), "{e}");
        png(&dir.path().join("dog/1.png"), 4, 4, true, |_, _| [9, 9, 9]);
        let e = load_folder(dir.path(), &[3, 4, 4], &expect, &t, Extent::All).expect_err("grey");
        assert!(e.contains("greyscale") && e.contains("dog/1.png"), "{e}");
        std::fs::write(dir.path().join("dog/1.png"), b"not a png").expect("w");
        let e = load_folder(dir.path(), &[3, 4, 4], &expect, &t, Extent::All).expect_err("unreadable");
        assert!(e.contains("not a readable image"), "{e}");
        let three = Expect { classes: Some(3), ..expect };
        let e = load_folder(dir.path(), &[3, 4, 4], &three, &t, Extent::All).expect_err("classes");
        assert!(e.contains("2 class folder(s) (cat, dog)") && e.contains("scores 3"), "{e}");
    }
}
