//! Lowering the spanned YAML tree into the typed spec ([`crate::ast`]), section by section.
//!
//! Lowering never stops at the first problem: each section is lowered on its own, each key
//! checked on its own, and every problem becomes a [`Diagnostic`]. A section that cannot be
//! lowered is `None`; later checks run on whatever sections are present.

use pipec_plan::model::{fmt_shape, Loss, Op};
use pipec_plan::plan::Fp8Plan;
use pipec_plan::rules;
use pipec_plan::vocab::{Fp8Recipe, Fp8Storage, TrainingPrecision};

use crate::cx::Fields;
use crate::diagnostic::Diagnostic;
use crate::dsl::Dimension;
use crate::schema::SchemaIndex;
use crate::span::Span;
use crate::yaml::{Node, Value};

pub use crate::ast::*;
pub(crate) use crate::cx::Lower;

/// The sections that lowered, and every diagnostic found on the way.
#[derive(Debug, Default)]
pub struct Lowered {
    pub name: Option<String>,
    pub engine: EngineChoice,
    pub model: Option<Model>,
    pub cluster: Option<Cluster>,
    pub strategy: Option<Strategy>,
    pub training: Option<Training>,
    pub diagnostics: Vec<Diagnostic>,
}

/// Lowers a parsed YAML document into the spec's sections. With `base_dir` (the spec's
/// directory), data files named in the spec must exist.
pub fn lower<'a>(src: &'a str, root: &Node, schema: &'a SchemaIndex, base_dir: Option<&'a std::path::Path>) -> Lowered {
    let mut cx = Lower::new(src, schema);
    cx.base_dir = base_dir;
    let mut out = Lowered::default();
    // Problems with the document as a whole are labelled at its first key.
    let doc_start = root.as_map().and_then(|m| m.first()).map(|(k, _)| k.span).unwrap_or(Span::new(0, 0));
    if matches!(root.value, Value::Null) {
        cx.push(
            Diagnostic::error(
                "E0104",
                "the spec is empty",
                Span::new(0, 0),
                "expected `model`, `cluster`, `strategy` and `training`",
            )
            .with_help("start from one of the examples in specs/"),
        );
        out.diagnostics = cx.diags;
        return out;
    }
    let Some(top) = cx.fields(root, &[], doc_start) else {
        out.diagnostics = cx.diags;
        return out;
    };
    out.name = top.get("name").and_then(|n| cx.output_path(n, "E0105", "my-run"));
    if let Some(node) = top.get("engine") {
        out.engine =
            lower_engine(&mut cx, node).unwrap_or(EngineChoice { span: Some(node.span), ..Default::default() });
    }
    let section = |cx: &mut Lower<'_>, key: &str| -> Option<(&Node, Span)> {
        let node = cx.required(&top, key, "spec")?;
        Some((node, top.key_span(key).unwrap_or(doc_start)))
    };
    out.model = section(&mut cx, "model").and_then(|(n, ks)| lower_model(&mut cx, n, ks));
    out.cluster = section(&mut cx, "cluster").and_then(|(n, ks)| lower_cluster(&mut cx, n, ks));
    if let Some(cluster) = &mut out.cluster {
        apply_engine_performance(&mut cx, &mut out.engine, cluster);
    }
    let strategy_node = section(&mut cx, "strategy");
    let engine = out.engine.target.name;
    out.training = section(&mut cx, "training").and_then(|(n, ks)| lower_training(&mut cx, n, ks, engine));
    if let (Some(model), Some(training)) = (&out.model, &out.training) {
        check_batch_size(&mut cx, model, training);
    }
    if let (Some(model), Some(training)) = (&out.model, &out.training) {
        check_image_transform(&mut cx, model, training);
    }
    if let (Some(model), Some(training), Some(base)) = (&out.model, &out.training, base_dir) {
        check_data_file(&mut cx, model, training, base);
    }
    out.strategy = strategy_node.and_then(|(n, ks)| {
        crate::strategy::lower_strategy(&mut cx, n, ks, out.model.as_ref(), out.cluster.as_ref(), out.training.as_ref())
    });
    if let (Some(model), Some(strategy), Some(training)) = (&out.model, &out.strategy, &out.training) {
        let sections = (strategy_node.map(|(n, _)| n), top.get("training"));
        crate::engine_check::check_engine(&mut cx, &out.engine, sections, model, strategy, training);
    }
    out.diagnostics = cx.diags;
    out
}

/// `engine:`: an engine's name, or a mapping with `name`, a quoted `version` (E0701 names a
/// release pipec does not describe), torchtitan's `compile` and a `calibration` file.
fn lower_engine(cx: &mut Lower<'_>, node: &Node) -> Option<EngineChoice> {
    use pipec_plan::engine::EngineTarget;
    let span = Some(node.span);
    if node.as_map().is_none() {
        let engine = cx.choose::<pipec_plan::vocab::Engine>(node, &["engine"])?;
        return Some(EngineChoice { target: EngineTarget::newest(engine), span, ..Default::default() });
    }
    let f = cx.fields(node, &["engine"], node.span)?;
    let name = cx.required(&f, "name", "engine")?;
    let engine = cx.choose::<pipec_plan::vocab::Engine>(name, &["engine", "name"])?;
    let target = match f.get("version") {
        None => EngineTarget::newest(engine),
        Some(version) => engine_version(cx, engine, version)?,
    };
    let (compiled, loss_compiled) = match f.get("compile") {
        None => (false, false),
        Some(c) => {
            let (model, loss) = compile_components(cx, c)?;
            if (model || loss) && engine != pipec_plan::vocab::Engine::Torchtitan {
                cx.push(
                    Diagnostic::error(
                        "E0105",
                        format!("`compile` is torchtitan's option; {engine} has none"),
                        c.span,
                        "not an option of this engine",
                    )
                    .with_help("remove `compile`, or name `torchtitan`: it compiles each block with torch.compile"),
                );
                return None;
            }
            (model, loss)
        }
    };
    let calibration = match f.get("calibration") {
        None => None,
        Some(c) => Some(read_calibration_file(cx, c)?),
    };
    Some(EngineChoice { target, span, compiled, loss_compiled, calibration, performance: None })
}

/// `engine.compile`: `true` (the model and the loss, torchtitan's default components),
/// `false`, or the list of what is compiled (`[model]`, `[model, loss]`, `[loss]`).
fn compile_components(cx: &mut Lower<'_>, node: &Node) -> Option<(bool, bool)> {
    use pipec_plan::vocab::CompileComponent;
    let items = match &node.value {
        Value::Seq(items) => items,
        Value::Bool(on) => return Some((*on, *on)),
        _ => {
            cx.wrong_type(node, "`true`, `false` or a list of what to compile, like `[model, loss]`");
            return None;
        }
    };
    let chosen: Option<Vec<CompileComponent>> =
        items.iter().map(|n| cx.choose::<CompileComponent>(n, &["engine", "compile"])).collect();
    let chosen = chosen?;
    Some((chosen.contains(&CompileComponent::Model), chosen.contains(&CompileComponent::Loss)))
}

/// `engine.version`: a quoted release pipec describes.
fn engine_version(
    cx: &mut Lower<'_>,
    engine: pipec_plan::vocab::Engine,
    version: &Node,
) -> Option<pipec_plan::engine::EngineTarget> {
    use pipec_plan::engine::{releases, EngineTarget};
    let Value::Str(text) = &version.value else {
        // `version: 0.10` is the number 0.1 to YAML: the text as written, quoted
        let written = cx.src.get(version.span.range()).unwrap_or_default().trim().to_string();
        let mut d = Diagnostic::error(
            "E0103",
            format!("`engine.version` must be a quoted string, found {}", version.value.kind_name()),
            version.span,
            "expected a string like \"0.19\"",
        )
        .with_help("quote the version: YAML reads 0.10 as the number 0.1");
        if !written.is_empty() && !matches!(version.value, Value::Map(_) | Value::Seq(_)) {
            d = d.with_fix("quote it", version.span, format!("\"{written}\""));
        }
        cx.push(d);
        return None;
    };
    match EngineTarget::resolve(engine, Some(text)) {
        Ok(target) => Some(target),
        Err(why) => {
            let r = releases(engine);
            cx.push(
                Diagnostic::error("E0701", format!("{engine} version `{text}`: {why}"), version.span, "not a release pipec describes")
                    .with_help(format!(
                        "pipec's description of {engine} covers {} (read at {}); name one of those releases or remove `version` for {}",
                        r.range_text(),
                        r.newest,
                        r.newest
                    ))
                    .with_fix(format!("use {}", r.newest), version.span, format!("\"{}\"", r.newest)),
            );
            None
        }
    }
}

/// `engine.calibration`: a calibration file (`pipec calibrate --measured`), relative to the
/// spec's directory.
fn read_calibration_file(
    cx: &mut Lower<'_>,
    f: &Node,
) -> Option<(pipec_plan::engine::performance::CalibrationFile, String, Span)> {
    let path = cx.string(f)?;
    let read = read_small_file(cx, path, "a calibration file")
        .and_then(|t| pipec_plan::engine::performance::CalibrationFile::from_json(&t));
    match read {
        Ok(file) => Some((file, path.to_string(), f.span)),
        Err(e) => {
            cx.push(
                Diagnostic::error(
                    "E0105",
                    format!("cannot use the calibration file `{path}`: {e}"),
                    f.span,
                    "this file",
                )
                .with_help("write one with `pipec calibrate --measured SPEC --step SECONDS -o FILE`"),
            );
            None
        }
    }
}

/// The engine's performance on the cluster's device: the calibration file's (checked to
/// be for this engine and device kind) or the fitted table's; the cluster's device model
/// is scaled by it, so every later pass prices the engine's kernels.
fn apply_engine_performance(cx: &mut Lower<'_>, engine: &mut EngineChoice, cluster: &mut Cluster) {
    use pipec_plan::engine::performance::Performance;
    let family = engine.family();
    let mut performance = match &engine.calibration {
        Some((file, path, span)) => match file.matches(family, &cluster.device) {
            Ok(()) => Performance::from_file(file, path),
            Err(why) => {
                cx.push(
                    Diagnostic::error("E0105", format!("the calibration file `{path}` is not for this run: {why}"), *span, "another engine or device")
                        .with_help("calibrate this engine on this device kind with `pipec calibrate --measured`, or remove `calibration`"),
                );
                return;
            }
        },
        None => Performance::of(family, &cluster.device),
    };
    performance.loss_compiled = engine.loss_compiled;
    cluster.run_engine_at(performance.efficiency);
    engine.performance = Some(performance);
}

/// The most values one batch's layer outputs may hold together (2^52, about 4.5·10^15):
/// with every tensor within `pipec_plan::model`'s limits and the batch within this, every
/// byte count the compiler forms fits in 64 bits.
pub const MAX_BATCH_ELEMENTS: u64 = 1 << 52;

/// The batch against the model's size: the values of every layer's output for the whole
/// batch, counted without wrapping, within [`MAX_BATCH_ELEMENTS`].
fn check_batch_size(cx: &mut Lower<'_>, model: &Model, training: &Training) {
    let per_sample = model
        .layers
        .iter()
        .map(|l| pipec_plan::model::elements(&l.output_shape))
        .chain([pipec_plan::model::elements(&model.input)])
        .try_fold(0u64, |sum, n| sum.checked_add(n?));
    let total = per_sample.and_then(|n| n.checked_mul(training.batch_size as u64));
    if total.is_some_and(|t| t <= MAX_BATCH_ELEMENTS) {
        return;
    }
    let shown = total.map_or("more than 2^64".to_string(), |t| t.to_string());
    cx.push(
        Diagnostic::error(
            "E0105",
            format!(
                "a batch of {} samples holds {shown} layer-output values, more than pipec plans (at most {MAX_BATCH_ELEMENTS})",
                training.batch_size
            ),
            training.batch_span,
            "too large a batch for this model",
        )
        .with_help("use a smaller batch_size (and more steps)"),
    );
}

/// An image folder's `resize` against the model's input: bounded before any image is
/// decoded (`pipec check` and the editor decode images too, and an unbounded resize
/// allocates what the machine does not have).
fn check_image_transform(cx: &mut Lower<'_>, model: &Model, training: &Training) {
    let Data::Images { resize: Some(resize), resize_span: Some(span), .. } = &training.data else { return };
    let [c, h, w] = model.input[..] else { return };
    if let Some(problem) = pipec_plan::images::resize_problem(*resize, [c, h, w]) {
        cx.push(
            Diagnostic::error("E0502", format!("`resize: {resize}` is too large: {problem}"), *span, "too large")
                .with_help(format!(
                    "resize sets the shorter side before the centre crop to the model's {h}×{w} input; torchvision's ImageNet recipe resizes to 256 for a 224 crop"
                )),
        );
    }
}

/// How much of a data file `pipec check` (and the editor) reads: enough to catch a wrong
/// layout or dtype and the first bad cells, bounded for any file.
pub const DATA_CHECK_BYTES: u64 = 4 << 20;

/// Reads the start of the data file(s) the spec names with the executor's own reader
/// (`pipec_plan::datafile`) and reports what would stop or spoil the run: shape, dtype,
/// labels out of range or not whole, non-finite values.
fn check_data_file(cx: &mut Lower<'_>, model: &Model, training: &Training, base: &std::path::Path) {
    let expect = pipec_plan::datafile::Expect::of(&model.input, model.output_shape(), model.loss, model.token_vocab());
    let extent = pipec_plan::datafile::Extent::Prefix(DATA_CHECK_BYTES);
    let lm = pipec_plan::model::language_model_positions(&model.input, model.output_shape(), model.token_vocab());
    let token_file = match &training.data {
        Data::Text { path, tokenizer: None, span } => Some((path, pipec_plan::datafile::TokenFile::Text, *span)),
        Data::Text { path, tokenizer: Some(t), span } => {
            Some((path, pipec_plan::datafile::TokenFile::Tokenized(base.join(t)), *span))
        }
        Data::Tokens { path, dtype: Some(d), span } => Some((path, pipec_plan::datafile::TokenFile::Raw(*d), *span)),
        Data::Tokens { path, dtype: None, span } => Some((path, pipec_plan::datafile::TokenFile::Npy, *span)),
        _ => None,
    };
    // a file of another kind than the spec says: named, with the kind to write instead
    use pipec_plan::datafile::Reading;
    let reading = match &training.data {
        Data::Text { path, span, .. } => Some((path, Reading::Text, span)),
        Data::Tokens { path, dtype: Some(_), span } => Some((path, Reading::RawTokens, span)),
        Data::Tokens { path, dtype: None, span } | Data::Npy { path, span, .. } => Some((path, Reading::Npy, span)),
        Data::Csv { path, span } => Some((path, Reading::Csv, span)),
        Data::Synthetic { .. } | Data::Images { .. } | Data::Records { .. } => None,
    };
    if let Some((path, reading, &span)) = reading {
        if let Some(kind) = pipec_plan::datafile::file_kind_mismatch(&base.join(path), reading) {
            cx.push(
                Diagnostic::error(
                    "E0502",
                    format!("`{path}` is {}, not {}", kind.name(), reading.name()),
                    span,
                    kind.name(),
                )
                .with_help(kind.advice()),
            );
            return;
        }
    }
    let (result, span) = if let Some((path, kind, span)) = token_file {
        let (Some(seq), Some(vocab)) = (lm, model.token_vocab()) else {
            cx.push(
                Diagnostic::error(
                    "E0502",
                    "token data trains a language model, and this model is not one",
                    span,
                    "token data",
                )
                .with_help(
                    "a language model starts with `embedding(vocab, d)` and ends with `linear(d, vocab)` on every position ([sequence, vocab] scores)",
                ),
            );
            return;
        };
        let full = base.join(path);
        let shown = full.display().to_string();
        let result = pipec_plan::datafile::load_tokens(&full, kind, vocab, extent)
            .and_then(|t| pipec_plan::datafile::token_windows(&t, seq, &shown));
        (result, span)
    } else {
        match &training.data {
            Data::Synthetic { .. } | Data::Text { .. } | Data::Tokens { .. } => return,
            Data::Records { span, .. } => {
                let Some(records) = training.data.records(base) else { return };
                let (Some(seq), Some(vocab)) = (lm, model.token_vocab()) else {
                    cx.push(
                        Diagnostic::error("E0502", "text records train a language model, and this model is not one", *span, "text records")
                            .with_help("a language model starts with `embedding(vocab, d)` and ends with `linear(d, vocab)` on every position ([sequence, vocab] scores)"),
                    );
                    return;
                };
                let shown = records.path.display().to_string();
                let result = pipec_plan::datafile::load_record_tokens(&records, vocab, extent)
                    .and_then(|t| pipec_plan::datafile::token_windows(&t, seq, &shown));
                (result, *span)
            }
            Data::Images { path, resize, mean, std, span, .. } => {
                let t = pipec_plan::images::Transform { resize: *resize, mean: mean.clone(), std: std.clone() };
                (pipec_plan::images::load_folder(&base.join(path), &model.input, &expect, &t, extent), *span)
            }
            Data::Csv { path, span } => (pipec_plan::datafile::load_csv(&base.join(path), &expect, extent), *span),
            Data::Npy { path, labels, span } => {
                let labels = labels.as_ref().map(|l| base.join(l));
                (pipec_plan::datafile::load_npy(&base.join(path), labels.as_deref(), &expect, extent), *span)
            }
        }
    };
    if let Err(e) = result {
        let base_shown = format!("`{}/", base.display());
        let mib = DATA_CHECK_BYTES >> 20;
        let (label, help) = match &training.data {
            Data::Images { .. } => (
                "this image folder",
                format!("`pipec check` lists every class and decodes images from each in turn, up to {mib} MiB of files; `pipec run` decodes and checks all of them"),
            ),
            _ => (
                "this data file",
                format!("`pipec check` reads the first {mib} MiB of a data file; `pipec run` reads and checks all of it"),
            ),
        };
        cx.push(
            Diagnostic::error(
                "E0502",
                format!("the data does not fit the model: {}", e.replace(&base_shown, "`")),
                span,
                label,
            )
            .with_help(help),
        );
    }
}

/// `model.mtp`: a depth, or `{ depth, weight }`.
fn lower_mtp(cx: &mut Lower<'_>, node: &Node) -> Option<pipec_plan::model::Mtp> {
    use pipec_plan::model::Mtp;
    if node.as_map().is_none() {
        let depth = cx.uint(node, 1)?;
        return Some(Mtp { depth, weight: Mtp::DEFAULT_WEIGHT });
    }
    let f = cx.fields(node, &["model", "mtp"], node.span)?;
    let depth = cx.required(&f, "depth", "model.mtp").and_then(|n| cx.uint(n, 1));
    let weight = match f.get("weight") {
        None => Some(Mtp::DEFAULT_WEIGHT),
        Some(w) => cx.number(w, pipec_plan::rules::Bound::Positive),
    };
    Some(Mtp { depth: depth?, weight: weight? })
}

/// Whether `model.mtp` has what multi-token prediction reads: a language model (an
/// embedding first, `linear(d, vocab)` last, the cross-entropy) with a causal transformer
/// block of the output layer's width; says why not (E0315).
fn mtp_fits(cx: &mut Lower<'_>, model: &Model) -> bool {
    let vocab = model.token_vocab();
    // the output layer's input width, where it scores the vocabulary
    let head = model.layers.last().and_then(|l| match l.op {
        Op::Linear { in_features, out_features, .. } if Some(out_features) == vocab => Some(in_features),
        _ => None,
    });
    let block = model.mtp_block().and_then(|b| b.block_dims().map(|d| (d.d, d.causal)));
    let why = match (vocab, head, block) {
        (None, _, _) => "multi-token prediction embeds tokens: the model must start with `embedding(vocab, d)`".to_string(),
        (Some(v), None, _) => {
            format!("multi-token prediction scores the vocabulary with the output layer: the model must end with `linear(d, {v})`")
        }
        (_, _, None) => "multi-token prediction repeats the model's last transformer block, and the model has none".to_string(),
        (_, _, Some((_, false))) => "multi-token prediction predicts later tokens from earlier ones: the last transformer block must be `causal=true`".to_string(),
        (_, Some(d_in), Some((d, true))) if d_in != d => format!(
            "the output layer reads {d_in} features and the last transformer block gives {d}: multi-token prediction feeds its block's output to the output layer"
        ),
        _ if model.loss != Loss::CrossEntropy => {
            "multi-token prediction adds cross-entropies over the vocabulary: the loss must be `cross_entropy`".to_string()
        }
        _ => return true,
    };
    cx.push(
        Diagnostic::error("E0315", format!("`mtp` does not fit this model: {why}"), model.mtp_span, "multi-token prediction")
            .with_help("`mtp` is DeepSeek-V3's multi-token prediction, for a causal language model: `embedding(vocab, d)`, transformer blocks, a norm, `linear(d, vocab)`, `loss: cross_entropy`"),
    );
    false
}

fn lower_model(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Model> {
    let f = cx.fields(node, &["model"], owner)?;
    let input_node = cx.required(&f, "input", "model");
    let layers_node = cx.required(&f, "layers", "model");
    let blocks_node = f.get("blocks");
    let loss_node = cx.required(&f, "loss", "model");
    let loss = loss_node.and_then(|n| cx.choose::<Loss>(n, &["model", "loss"]));
    let attention = match f.get("attention") {
        None => Some(Attention::Standard),
        Some(n) => cx.choose::<Attention>(n, &["model", "attention"]),
    };

    let input = input_node.and_then(|n| {
        let Value::Seq(items) = &n.value else {
            cx.wrong_type(n, "a list of dimensions like `[784]` or `[3, 32, 32]`");
            return None;
        };
        if items.is_empty() {
            cx.push(Diagnostic::error("E0105", "the input shape is empty", n.span, "needs at least one dimension"));
            return None;
        }
        let dims: Vec<Option<usize>> = items.iter().map(|d| cx.uint(d, 1)).collect();
        let dims = dims.into_iter().collect::<Option<Vec<usize>>>()?;
        if let Err(m) = pipec_plan::model::check_shape(&dims) {
            cx.push(
                Diagnostic::error("E0105", format!("the input {m}"), n.span, "too large")
                    .with_help("pipec plans up to 2^32 per dimension and 2^40 elements per sample"),
            );
            return None;
        }
        Some(dims)
    });

    let expanded = layers_node.and_then(|n| {
        if matches!(&n.value, Value::Seq(items) if items.is_empty()) {
            cx.push(Diagnostic::error("E0105", "the model has no layers", n.span, "add at least one layer"));
            return None;
        }
        Some(crate::graph::expand(cx, n, blocks_node, input.as_deref()))
    });
    let expanded = expanded.filter(|e| e.ok);
    let mtp = match f.get("mtp") {
        None => Some(None),
        Some(n) => lower_mtp(cx, n).map(Some),
    };
    let mtp_span = f.get("mtp").map_or(owner, |n| n.span);
    let (input, expanded, loss, attention, mtp) = (input?, expanded?, loss?, attention?, mtp?);
    let crate::graph::Expanded { layers, groups, names, .. } = expanded;
    let loss_node = loss_node?;
    let model = Model {
        input_span: input_node.map(|n| n.span).unwrap_or(owner),
        layers_span: layers_node.map(|n| n.span).unwrap_or(owner),
        loss_span: loss_node.span,
        input,
        layers,
        loss,
        attention,
        groups,
        names,
        mtp,
        mtp_span,
    };
    if mtp.is_some() && !mtp_fits(cx, &model) {
        return None;
    }
    // The loss needs a vector output (a language model's [sequence, vocab] for cross-entropy);
    // cross-entropy needs at least two classes.
    let out = model.output_shape();
    let last_span = model.layers.last().map(|l| l.span).unwrap_or(model.input_span);
    let lm = pipec_plan::model::language_model_positions(&model.input, out, model.token_vocab()).is_some();
    match loss {
        Loss::CrossEntropy if lm => Some(model),
        Loss::CrossEntropy if out.len() == 2 && model.token_vocab().is_some() => {
            let vocab = model.token_vocab().unwrap_or(0);
            cx.push(
                Diagnostic::error(
                    "E0306",
                    format!(
                        "`cross_entropy` over positions is a language model's next-token loss and needs [{}, {vocab}] scores (one per token of the vocabulary), but the model outputs {}",
                        model.input.first().copied().unwrap_or(0),
                        fmt_shape(out)
                    ),
                    loss_node.span,
                    format!("needs [sequence, {vocab}]"),
                )
                .with_label(last_span, format!("the last layer outputs {}", fmt_shape(out)))
                .with_help(format!(
                    "a language model ends with `linear(d, {vocab})`, scoring every token of the vocabulary at every position (its labels are the next tokens); a classifier of the whole sequence pools the positions first (`flatten` then `linear(features, classes)`); labels per position other than the next token are not supported"
                )),
            );
            None
        }
        Loss::CrossEntropy if out.len() != 1 || out[0] < 2 => {
            cx.push(
                Diagnostic::error(
                    "E0306",
                    format!(
                        "`cross_entropy` needs a vector of at least 2 class scores, but the model outputs {}",
                        fmt_shape(out)
                    ),
                    loss_node.span,
                    "needs [classes]",
                )
                .with_label(last_span, format!("the last layer outputs {}", fmt_shape(out)))
                .with_help("end the model with `flatten` and/or `linear(features, classes)`"),
            );
            None
        }
        Loss::Mse if out.len() != 1 => {
            cx.push(
                Diagnostic::error(
                    "E0306",
                    format!("`mse` needs a vector output, but the model outputs {}", fmt_shape(out)),
                    loss_node.span,
                    "needs a vector output",
                )
                .with_label(last_span, format!("the last layer outputs {}", fmt_shape(out)))
                .with_help("end the model with `flatten` and/or a final `linear`"),
            );
            None
        }
        _ => Some(model),
    }
}

fn lower_link(
    cx: &mut Lower<'_>,
    node: &Node,
    owner: Span,
    level: &str,
    devices_per_node: Option<usize>,
) -> Option<Link> {
    let path = ["cluster", "links", level];
    let f = cx.fields(node, &path, owner)?;
    let section = format!("cluster.links.{level}");
    // a link `pipec calibrate --concurrent N` measured, each figure overridable
    let measured = match f.get("file") {
        None => None,
        Some(n) => {
            let d = read_device_file(cx, n)?;
            match d.link {
                Some(l) => Some(l),
                None => {
                    cx.push(
                        Diagnostic::error(
                            "E0105",
                            format!("the device file `{}` has no link measurement", n.as_str().unwrap_or_default()),
                            n.span,
                            "no `link` in it",
                        )
                        .with_help("measure the link between workers with `pipec calibrate --concurrent 2 -o FILE`"),
                    );
                    return None;
                }
            }
        }
    };
    let figure = |cx: &mut Lower<'_>, key: &str, dim: Dimension, zero: bool, from: Option<f64>| match (f.get(key), from)
    {
        (Some(n), _) => cx.quantity(n, dim, zero),
        (None, Some(v)) => Some(v),
        (None, None) => cx.required(&f, key, &section).and_then(|n| cx.quantity(n, dim, zero)),
    };
    let bw = figure(cx, "bandwidth", Dimension::Bandwidth, false, measured.map(|l| l.bandwidth));
    let lat = figure(cx, "latency", Dimension::Time, true, measured.map(|l| l.latency));
    let efficiency = match f.get("efficiency") {
        None => Some(measured.map_or(1.0, |l| l.efficiency)),
        Some(value) => cx.number(value, rules::Bound::Positive).and_then(|e| {
            if e <= 1.0 {
                Some(e)
            } else {
                cx.push(Diagnostic::error("E0105", format!("efficiency {e} is above 1"), value.span, "at most 1"));
                None
            }
        }),
    };
    let bandwidth = bw?;
    if level == "inter_node" {
        if let Some(n) = f.get("bandwidth") {
            per_device_bandwidth(cx, n, bandwidth, devices_per_node);
        }
    }
    Some(Link { bandwidth, latency: lat?, efficiency: efficiency? })
}

/// W0106: `inter_node.bandwidth` is each device's share of the network, and a figure past
/// the fastest network adapter one device has ([`pipec_plan::device::FASTEST_NIC`]) is most
/// likely a node's total (DGX H100's 8 × 400 Gb/s written as 3200Gbps gives each GPU 8× its
/// bandwidth).
fn per_device_bandwidth(cx: &mut Lower<'_>, n: &Node, bandwidth: f64, devices_per_node: Option<usize>) {
    use pipec_plan::device::FASTEST_NIC;
    if bandwidth <= FASTEST_NIC.bytes_per_s {
        return;
    }
    let gbps = |b: f64| format!("{}Gbps", (b * 8.0 / 1e9 * 10.0).round() / 10.0);
    let share = match devices_per_node.filter(|&d| d > 1) {
        Some(d) => format!(
            "if {} is the node's total, write each device's share, {} (÷ {d} devices per node)",
            gbps(bandwidth),
            gbps(bandwidth / d as f64)
        ),
        None => "if it is a node's total, divide it by the devices per node".to_string(),
    };
    cx.push(
        Diagnostic::warning(
            "W0106",
            format!(
                "`inter_node.bandwidth` is per device, and {} is more than one device's network adapter carries",
                gbps(bandwidth)
            ),
            n.span,
            format!("more than {} per device", gbps(FASTEST_NIC.bytes_per_s)),
        )
        .with_help(format!("{share}; the bound is {}", FASTEST_NIC.source)),
    );
}

/// `name` is not a preset of `kind`: E0105 with the nearest name and the list.
fn unknown_preset(cx: &mut Lower<'_>, node: &Node, kind: &str, name: &str, names: &[&str]) {
    let mut d = Diagnostic::error("E0105", format!("unknown {kind} preset `{name}`"), node.span, "not a preset");
    d = match crate::diagnostic::did_you_mean(name, names.iter().copied()) {
        Some(s) => d.with_help(format!("did you mean `{s}`? presets: {}", names.join(", "))),
        None => d.with_help(format!("presets: {}", names.join(", "))),
    };
    cx.push(d);
}

/// `cluster.device`: a preset's name, or a mapping (a preset or a device file with
/// overrides, or a memory and one throughput). The device model, its memory's span and the
/// executor's work per layer forward and backward (`overhead`).
fn lower_device(
    cx: &mut Lower<'_>,
    n: &Node,
    owner: Span,
) -> Option<(pipec_plan::device::DeviceModel, Span, (f64, f64))> {
    use pipec_plan::device::{preset, DeviceModel, MatrixRates, PRESETS};
    let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
    if let Some(name) = n.as_str() {
        return match preset(name) {
            Some(p) => Some((p.model(), n.span, (0.0, 0.0))),
            None => {
                unknown_preset(cx, n, "device", name, &names);
                None
            }
        };
    }
    let df = cx.fields(n, &["cluster", "device"], owner)?;
    let base: Option<DeviceModel> = match (df.get("preset"), df.get("file")) {
        (Some(_), Some(f)) => {
            cx.push(
                Diagnostic::error(
                    "E0105",
                    "`preset` and `file` both describe the device: give one",
                    f.span,
                    "the preset would be taken and this file never read",
                )
                .with_help("a device file (`pipec calibrate -o FILE`) is a measured device; a preset is a published one; override single figures beside either (`memory: 80GiB`)"),
            );
            return None;
        }
        (Some(p), None) => {
            let name = cx.string(p)?;
            match preset(name) {
                Some(found) => Some(capped_preset(cx, found, df.get("power"))?),
                None => {
                    unknown_preset(cx, p, "device", name, &names);
                    return None;
                }
            }
        }
        (None, Some(f)) => Some(read_device_file(cx, f)?),
        (None, None) => None,
    };
    if let (Some(w), None) = (df.get("power"), df.get("preset")) {
        cx.push(
            Diagnostic::error("E0105", "`power` caps a preset's device: name the preset", w.span, "no preset to cap")
                .with_help("write `preset: h100-sxm` beside `power`; a device file is measured at the power it ran at"),
        );
        return None;
    }
    let mut ok = true;
    let mut quantity = |cx: &mut Lower<'_>, key: &str, dim: Dimension, zero: bool| -> Option<f64> {
        let v = df.get(key).map(|q| cx.quantity(q, dim, zero));
        if matches!(v, Some(None)) {
            ok = false;
        }
        v.flatten()
    };
    let memory = quantity(cx, "memory", Dimension::Bytes, false);
    let throughput = quantity(cx, "throughput", Dimension::FlopRate, false);
    let vector = quantity(cx, "vector", Dimension::FlopRate, false);
    let bandwidth = quantity(cx, "memory_bandwidth", Dimension::Bandwidth, false);
    let launch = quantity(cx, "launch", Dimension::Time, true);
    let overhead = quantity(cx, "overhead", Dimension::Time, true);
    let mut device = match base {
        Some(d) => d,
        None => {
            // the one-throughput device: memory and throughput are what it is
            if memory.is_none() && df.get("memory").is_none() {
                cx.required(&df, "memory", "cluster.device");
            }
            if throughput.is_none() && df.get("throughput").is_none() {
                cx.required(&df, "throughput", "cluster.device");
            }
            DeviceModel::uniform("device", memory?, throughput?)
        }
    };
    if !ok {
        return None;
    }
    if let Some(k) = df.get("kind").and_then(|k| cx.string(k)) {
        device.name = k.to_string();
    }
    if let Some(m) = memory {
        device.memory = m;
    }
    if let Some(t) = throughput {
        device.matrix = MatrixRates::uniform(t);
        if vector.is_none() && !device.memory_bandwidth.is_finite() {
            device.vector = t;
        }
    }
    if let Some(v) = vector {
        device.vector = v;
    }
    if let Some(b) = bandwidth {
        device.memory_bandwidth = b;
    }
    if let Some(l) = launch {
        device.launch = l;
    }
    let span = df.get("memory").or(df.get("preset")).or(df.get("file")).map_or(n.span, |m| m.span);
    // the spec's own overhead, else the one `pipec calibrate` measured for a device file
    let overhead = match overhead {
        Some(o) => (o, 2.0 * o),
        None => device.layer_overheads(),
    };
    Some((device, span, overhead))
}

/// A preset's device, at the power cap `power` gives (at most the board's power).
fn capped_preset(
    cx: &mut Lower<'_>,
    p: &'static pipec_plan::device::Preset,
    power: Option<&Node>,
) -> Option<pipec_plan::device::DeviceModel> {
    let Some(node) = power else { return Some(p.model()) };
    let watts = cx.quantity(node, Dimension::Power, false)?;
    if watts > p.tdp_w {
        cx.push(
            Diagnostic::error(
                "E0105",
                format!("a power cap of {watts} W is above the {} W board power of `{}`", p.tdp_w, p.name),
                node.span,
                "above the board's power",
            )
            .with_help(format!("a cap is at most {} W; remove `power` to run the device at its full power", p.tdp_w)),
        );
        return None;
    }
    Some(p.model_at(watts))
}

/// The largest device or calibration file read.
const MAX_DEVICE_FILE: u64 = 1 << 20;

/// A file a spec names (relative to the spec's directory), read whole if it is no larger
/// than a device file (`kind` names it in the error).
fn read_small_file(cx: &Lower<'_>, path: &str, kind: &str) -> Result<String, String> {
    let full = match cx.base_dir {
        Some(base) => base.join(path),
        None => std::path::PathBuf::from(path),
    };
    let size = std::fs::metadata(&full).map_err(|e| e.to_string())?.len();
    if size > MAX_DEVICE_FILE {
        return Err(format!("it has {size} bytes; {kind} is far smaller"));
    }
    std::fs::read_to_string(&full).map_err(|e| e.to_string())
}

/// A device file (`pipec calibrate`'s JSON), relative to the spec's directory.
fn read_device_file(cx: &mut Lower<'_>, f: &Node) -> Option<pipec_plan::device::DeviceModel> {
    let path = cx.string(f)?;
    let read = read_small_file(cx, path, "a device file").and_then(|t| pipec_plan::device::DeviceModel::from_json(&t));
    match read {
        Ok(d) => Some(d),
        Err(e) => {
            cx.push(
                Diagnostic::error("E0105", format!("cannot use the device file `{path}`: {e}"), f.span, "this file")
                    .with_help("write one with `pipec calibrate -o FILE`"),
            );
            None
        }
    }
}

/// `cluster.links`: an interconnect preset's name, or the links per level.
fn lower_links(
    cx: &mut Lower<'_>,
    n: &Node,
    owner: Span,
    devices_per_node: Option<usize>,
) -> Option<(Link, Option<Link>, bool, Span)> {
    if let Some(name) = n.as_str() {
        let names: Vec<&str> = pipec_plan::device::LINK_PRESETS.iter().map(|p| p.name).collect();
        return match pipec_plan::device::link_preset(name) {
            Some(p) => {
                let link =
                    |(gbps, latency, efficiency): (f64, f64, f64)| Link { bandwidth: gbps * 1e9, latency, efficiency };
                Some((link(p.intra), Some(link(p.inter)), true, owner))
            }
            None => {
                unknown_preset(cx, n, "interconnect", name, &names);
                None
            }
        };
    }
    let lf = cx.fields(n, &["cluster", "links"], owner)?;
    let intra = cx
        .required(&lf, "intra_node", "cluster.links")
        .and_then(|l| lower_link(cx, l, lf.key_span("intra_node").unwrap_or(owner), "intra_node", devices_per_node));
    let inter_node = lf.get("inter_node");
    let inter = inter_node
        .and_then(|l| lower_link(cx, l, lf.key_span("inter_node").unwrap_or(owner), "inter_node", devices_per_node));
    Some((intra?, inter, inter_node.is_some(), owner))
}

fn lower_cluster(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Cluster> {
    let f = cx.fields(node, &["cluster"], owner)?;
    let nodes = cx.required(&f, "nodes", "cluster").and_then(|n| cx.uint(n, 1));
    let dpn_node = cx.required(&f, "devices_per_node", "cluster");
    let dpn = dpn_node.and_then(|n| cx.uint(n, 1));
    let device =
        cx.required(&f, "device", "cluster").and_then(|n| lower_device(cx, n, f.key_span("device").unwrap_or(owner)));
    let links = cx
        .required(&f, "links", "cluster")
        .and_then(|n| lower_links(cx, n, f.key_span("links").unwrap_or(n.span), dpn));
    let (nodes, dpn, (device, memory_span, (overhead, overhead_backward)), (intra, inter, inter_given, links_key)) =
        (nodes?, dpn?, device?, links?);
    if nodes.checked_mul(dpn).is_none_or(|n| n > MAX_DEVICES) {
        cx.push(
            Diagnostic::error(
                "E0105",
                format!(
                    "a cluster of {nodes} × {dpn} devices is larger than pipec plans ({MAX_DEVICES} devices at most)"
                ),
                dpn_node.map_or(node.span, |n| n.span),
                "too many devices",
            )
            .with_help("plan one representative slice of the cluster (data parallelism replicates it)"),
        );
        return None;
    }
    if nodes > 1 && inter.is_none() {
        if !inter_given {
            cx.push(
                Diagnostic::error(
                    "E0104",
                    format!("a cluster of {nodes} nodes needs `links.inter_node`"),
                    links_key,
                    "`inter_node` is missing here",
                )
                .with_help("add `inter_node: { bandwidth: 100Gbps, latency: 10us }` (your network's figures)"),
            );
        }
        return None;
    }
    Some(Cluster {
        nodes,
        devices_per_node: dpn,
        memory: device.memory,
        device,
        memory_span,
        overhead,
        overhead_backward,
        devices_span: dpn_node.map(|n| n.span).unwrap_or(node.span),
        intra_node: intra,
        inter_node: inter,
        span: node.span,
    })
}

fn lower_training(cx: &mut Lower<'_>, node: &Node, owner: Span, engine: pipec_plan::vocab::Engine) -> Option<Training> {
    let f = cx.fields(node, &["training"], owner)?;
    let batch_node = cx.required(&f, "batch_size", "training");
    let batch = batch_node.and_then(|n| cx.uint(n, rules::training_minimum("batch_size")));
    let steps = cx.required(&f, "steps", "training").and_then(|n| cx.uint(n, rules::training_minimum("steps")));
    // `precision: auto`: the strategy search tries bf16 and FP8 (bf16 is the baseline the
    // rest of the spec is checked with)
    let searched = f.get("precision").filter(|n| crate::strategy::is_auto(n)).map(|n| n.span);
    let trained = match f.get("precision") {
        None => Some(TrainingPrecision::Fp32),
        Some(_) if searched.is_some() => Some(TrainingPrecision::Bf16),
        Some(n) => cx.choose::<TrainingPrecision>(n, &["training", "precision"]),
    };
    let optimized = cx
        .required(&f, "optimizer", "training")
        .and_then(|n| lower_optimizer(cx, n, f.key_span("optimizer").unwrap_or(owner), trained));
    let (optimizer, state_precision) = (optimized.map(|o| o.0), optimized.map_or(Precision::Fp32, |o| o.1));
    let master_weights = optimized.map_or(Some(true), |o| o.2);
    let precision = trained.map(TrainingPrecision::values);
    let fp8 = lower_fp8(cx, &f, if searched.is_some() { Some(TrainingPrecision::Fp8) } else { trained }, engine);
    let (fp8, precision_search) = match (searched, fp8) {
        (Some(span), Some(Some(fp8))) => (Some(None), Some(PrecisionSearch { span, fp8 })),
        (_, fp8) => (fp8, None),
    };
    let grad_precision = match f.get("grad_precision") {
        None => precision.map(|_| Precision::Fp32),
        Some(n) => cx.choose::<Precision>(n, &["training", "grad_precision"]),
    };
    let seed = match f.get("seed") {
        None => Some(0),
        Some(n) => cx.uint(n, 0).map(|s| s as u64),
    };
    let data = match f.get("data") {
        None => Some(Data::Synthetic { task: Task::Classification, samples: None }),
        Some(n) => lower_data(cx, n, f.key_span("data").unwrap_or(owner)),
    };
    let checkpoint = match f.get("checkpoint") {
        None => Some(None),
        Some(n) => {
            cx.fields(n, &["training", "checkpoint"], f.key_span("checkpoint").unwrap_or(owner)).and_then(|cf| {
                let every = cx
                    .required(&cf, "every", "training.checkpoint")
                    .and_then(|e| cx.uint(e, rules::training_minimum("checkpoint_every")));
                let dir = match cf.get("dir") {
                    None => Some("checkpoints".to_string()),
                    Some(d) => cx.output_path(d, "E0503", "checkpoints"),
                };
                let asynchronous = cf.get("async").map_or(Some(true), |n| cx.boolean(n));
                Some(Some(Checkpoint { every: every?, dir: dir?, asynchronous: asynchronous? }))
            })
        }
    };
    let recipe = lower_recipe(cx, &f, steps, batch, optimizer.as_ref(), data.as_ref());
    Some(Training {
        batch_size: batch?,
        batch_span: batch_node.map(|n| n.span).unwrap_or(owner),
        steps: steps?,
        optimizer: optimizer?,
        precision: precision?,
        grad_precision: grad_precision?,
        fp8: fp8?,
        precision_search,
        state_precision,
        master_weights: master_weights?,
        seed: seed?,
        data: data?,
        checkpoint: checkpoint?,
        recipe: recipe?,
    })
}

/// `fp8`: how FP8 training runs (with `precision: fp8`; E0505 without). Its defaults are
/// current (per-tensor) scaling and the storage of the spec's engine
/// ([`Fp8Plan::of_engine`]: Transformer Engine's, or torchao's under torchtitan).
fn lower_fp8(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    trained: Option<TrainingPrecision>,
    engine: pipec_plan::vocab::Engine,
) -> Option<Option<Fp8Plan>> {
    let default = Fp8Plan::of_engine(engine, Fp8Recipe::default());
    let Some(n) = f.get("fp8") else {
        return Some((trained? == TrainingPrecision::Fp8).then_some(default));
    };
    if trained.is_some_and(|t| t != TrainingPrecision::Fp8) {
        cx.push(
            Diagnostic::error(
                "E0505",
                "`fp8` says how FP8 training runs, and `precision` is not `fp8`",
                f.key_span("fp8").unwrap_or(n.span),
                "applies only with `precision: fp8`",
            )
            .with_help("set `precision: fp8`, or remove `fp8`"),
        );
        return None;
    }
    let ff = cx.fields(n, &["training", "fp8"], f.key_span("fp8").unwrap_or(n.span))?;
    let recipe =
        ff.get("recipe").map_or(Some(default.recipe), |r| cx.choose::<Fp8Recipe>(r, &["training", "fp8", "recipe"]));
    let activations = ff
        .get("activations")
        .map_or(Some(default.activations), |a| cx.choose::<Fp8Storage>(a, &["training", "fp8", "activations"]));
    let gather =
        ff.get("gather").map_or(Some(default.gather), |g| cx.choose::<Fp8Storage>(g, &["training", "fp8", "gather"]));
    let weight_copies = ff.get("weight_copies").map_or(Some(default.weight_copies), |w| cx.boolean(w));
    trained?;
    Some(Some(Fp8Plan { recipe: recipe?, activations: activations?, weight_copies: weight_copies?, gather: gather? }))
}

/// `lr_schedule`, `clip_grad_norm` and `shuffle` (E0504 where the recipe's rules are broken,
/// at the key at fault).
fn lower_recipe(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    steps: Option<usize>,
    batch: Option<usize>,
    optimizer: Option<&Optimizer>,
    data: Option<&Data>,
) -> Option<pipec_plan::recipe::Recipe> {
    use pipec_plan::recipe::{LrSchedule, Recipe};
    let lr_schedule = match f.get("lr_schedule") {
        None => Some(None),
        Some(n) => {
            cx.fields(n, &["training", "lr_schedule"], f.key_span("lr_schedule").unwrap_or(n.span)).and_then(|sf| {
                let warmup = match sf.get("warmup") {
                    None => Some(0),
                    Some(w) => cx.uint(w, 0),
                };
                let decay = match sf.get("decay") {
                    None => Some(pipec_plan::vocab::Decay::Constant),
                    Some(d) => cx.choose::<pipec_plan::vocab::Decay>(d, &["training", "lr_schedule", "decay"]),
                };
                let decay_steps = match sf.get("decay_steps") {
                    None => Some(steps.unwrap_or(1)),
                    Some(d) => cx.uint(d, 1),
                };
                let min_lr = match sf.get("min_lr") {
                    None => Some(0.0),
                    Some(m) => cx.number(m, pipec_plan::rules::Bound::NonNegative),
                };
                Some(Some(LrSchedule { warmup: warmup?, decay: decay?, decay_steps: decay_steps?, min_lr: min_lr? }))
            })
        }
    };
    let clip_grad_norm = match f.get("clip_grad_norm") {
        None => Some(None),
        Some(n) => cx.number(n, pipec_plan::rules::Bound::Positive).map(Some),
    };
    let shuffle = match f.get("shuffle") {
        None => Some(false),
        Some(n) => cx.boolean(n),
    };
    let validation = match f.get("validation") {
        None => Some(None),
        Some(n) => {
            cx.fields(n, &["training", "validation"], f.key_span("validation").unwrap_or(n.span)).and_then(|vf| {
                let every = cx.required(&vf, "every", "training.validation").and_then(|e| cx.uint(e, 1));
                let split = cx
                    .required(&vf, "split", "training.validation")
                    .and_then(|s| cx.number(s, pipec_plan::rules::Bound::Fraction));
                Some(Some(pipec_plan::recipe::Validation { every: every?, split: split? }))
            })
        }
    };
    let running_stats = match f.get("running_stats") {
        None => Some(pipec_plan::recipe::RunningStats::PerUpdate),
        Some(n) => cx.choose::<pipec_plan::recipe::RunningStats>(n, &["training", "running_stats"]),
    };
    let recipe = Recipe {
        lr_schedule: lr_schedule?,
        clip_grad_norm: clip_grad_norm?,
        shuffle: shuffle?,
        validation: validation?,
        running_stats: running_stats?,
    };
    let (Some(optimizer), Some(data)) = (optimizer, data) else { return Some(recipe) };
    let finite = !matches!(data, Data::Synthetic { samples: None, .. });
    let mut ok = true;
    let mut problems = recipe.problems(optimizer.lr(), finite);
    // synthetic data's size is known now (a file's when it is read: `pipec check` reads it)
    if let (Data::Synthetic { samples: Some(n), .. }, Some(batch)) = (data, batch) {
        problems.extend(recipe.held_out_problem(*n, batch).map(|p| ("validation", p)));
    }
    for (key, problem) in problems {
        let span = f.get(key).map_or(f.owner, |n| n.span);
        let label = match key {
            "lr_schedule" => "this schedule",
            "shuffle" | "validation" if !finite => "the data set has no end",
            "validation" => "this validation",
            _ => "not a norm a gradient can be clipped to",
        };
        cx.push(
            Diagnostic::error("E0504", problem, span, label).with_help(match key {
                "lr_schedule" => "the learning rate warms up from 0 to the optimizer's `lr` over `warmup` steps, then decays to `min_lr` (at most `lr`) by `decay_steps` (past the warm-up)",
                "shuffle" => "give the synthetic data a size (`samples: N`), or remove `shuffle`",
                "validation" => "validation evaluates every `every` (≥ 1) steps on the last `split` of a data set of a finite size: at least one whole batch, with samples left to train on, e.g. `validation: { every: 50, split: 0.1 }`",
                _ => "clip_grad_norm is the largest norm the whole gradient may have",
            }),
        );
        ok = false;
    }
    ok.then_some(recipe)
}

/// The optimizer, its moments' precision (`state_precision`, fp32 unless given) and whether
/// it keeps master weights (`master_weights`; None: written, but not a boolean).
fn lower_optimizer(
    cx: &mut Lower<'_>,
    node: &Node,
    owner: Span,
    trained: Option<TrainingPrecision>,
) -> Option<(Optimizer, Precision, Option<bool>)> {
    let f = cx.fields(node, &["training", "optimizer"], owner)?;
    let mut master = f.get("master_weights").map_or(Some(true), |n| cx.boolean(n));
    if let (Some(false), Some(TrainingPrecision::Fp32), Some(span)) = (master, trained, f.key_span("master_weights")) {
        cx.push(
            Diagnostic::error(
                "E0501",
                "`master_weights: false` drops the fp32 copy a bf16 or fp16 model's optimizer updates, and an fp32 model's weights are their own",
                span,
                "no master copy to drop",
            )
            .with_help("remove it, or train in `precision: bf16` with the weights kept in bf16 alone"),
        );
        master = None;
    }
    let state = match f.get("state_precision") {
        None => Some(Precision::Fp32),
        Some(n) => cx.choose::<Precision>(n, &["training", "optimizer", "state_precision"]),
    };
    let optimizer = lower_optimizer_kind(cx, &f)?;
    if optimizer.state_per_parameter() == 0 {
        if let Some(span) = f.key_span("state_precision") {
            cx.push(
                Diagnostic::error(
                    "E0501",
                    "`state_precision` is the precision of an optimizer's state, and plain `sgd` keeps none",
                    span,
                    "no state to keep",
                )
                .with_help("remove it, or choose an optimizer with a state (`momentum`, `adam`, `adamw`)"),
            );
            return None;
        }
    }
    Some((optimizer, state?, master))
}

fn lower_optimizer_kind(cx: &mut Lower<'_>, f: &Fields<'_>) -> Option<Optimizer> {
    let kind = cx
        .required(f, "kind", "training.optimizer")
        .and_then(|n| cx.choose::<OptimizerKind>(n, &["training", "optimizer", "kind"]));
    let lr = cx.required(f, "lr", "training.optimizer").and_then(|n| cx.number(n, rules::optimizer_bound("lr")));
    let opt_f = |cx: &mut Lower<'_>, key: &str, default: f64| match f.get(key) {
        None => Some(default),
        Some(n) => cx.number(n, rules::optimizer_bound(key)),
    };
    let kind = kind?;
    let not_for = |cx: &mut Lower<'_>, keys: &[&str], kind: &str| {
        for k in keys {
            if let Some(span) = f.key_span(k) {
                cx.push(
                    Diagnostic::error(
                        "E0501",
                        format!("`{k}` does not apply to the `{kind}` optimizer"),
                        span,
                        format!("not an option of `{kind}`"),
                    )
                    .with_help("remove it, or choose an optimizer that has it"),
                );
            }
        }
    };
    let wd = opt_f(cx, "weight_decay", 0.0);
    match kind {
        OptimizerKind::Adam | OptimizerKind::AdamW => {
            not_for(cx, &["momentum"], kind.name());
            let b1 = opt_f(cx, "beta1", 0.9);
            let b2 = opt_f(cx, "beta2", 0.999);
            let eps = opt_f(cx, "eps", 1e-8);
            let decoupled = kind == OptimizerKind::AdamW;
            if !decoupled {
                not_for(cx, &["decay_biases_and_norms"], kind.name());
            }
            let decay_biases_and_norms = match f.get("decay_biases_and_norms") {
                Some(n) if decoupled => cx.boolean(n),
                _ => Some(true),
            };
            Some(Optimizer::Adam {
                lr: lr?,
                beta1: b1?,
                beta2: b2?,
                eps: eps?,
                weight_decay: wd?,
                decoupled,
                decay_biases_and_norms: decay_biases_and_norms?,
            })
        }
        OptimizerKind::Sgd | OptimizerKind::Momentum => {
            not_for(cx, &["beta1", "beta2", "eps", "decay_biases_and_norms"], kind.name());
            let default_m = if kind == OptimizerKind::Momentum { 0.9 } else { 0.0 };
            let m = opt_f(cx, "momentum", default_m);
            Some(Optimizer::Sgd { lr: lr?, momentum: m?, weight_decay: wd? })
        }
    }
}

/// The data keys that apply to some kinds of data only: the kinds, and what the key does.
const DATA_KEYS: &[(&str, &[&str], &str)] = &[
    ("task", &["synthetic"], "chooses what synthetic data is made for"),
    ("samples", &["synthetic"], "sizes a synthetic data set"),
    ("path", &["csv", "npy", "text", "tokens", "images", "jsonl", "parquet", "arrow"], "names a data file or folder"),
    ("labels", &["npy"], "names an NPY file's labels"),
    ("dtype", &["tokens"], "is a raw token file's integer type"),
    ("tokenizer", &["text", "jsonl", "parquet", "arrow"], "cuts text into a language model's tokens"),
    ("field", &["jsonl"], "names the text's field in a JSON Lines file's records"),
    ("column", &["parquet", "arrow"], "names the text's (or token ids') column"),
    ("eot", &["jsonl", "parquet", "arrow"], "is the token put between records"),
    ("resize", &["images"], "transforms an image folder's images"),
    ("mean", &["images"], "transforms an image folder's images"),
    ("std", &["images"], "transforms an image folder's images"),
];

/// E0502 when a data kind's file (`what`: data, labels, tokenizer) is not there: a folder
/// where a file belongs is said to be one (text data may be a folder of `.txt` files or a
/// pattern of file names, and a tokenizer a model folder holding `tokenizer.json`).
fn missing_file(kind: &str, what: &str, rel: &str, full: &std::path::Path, span: Span) -> Option<Diagnostic> {
    let error = |message: String, label: &str, help: &str| {
        Some(Diagnostic::error("E0502", message, span, label.to_string()).with_help(help.to_string()))
    };
    match (kind, what) {
        // a `datasets` save_to_disk folder
        ("arrow", "data") if full.is_dir() => None,
        ("text", "data") => match pipec_plan::datafile::text_files(full) {
            Ok(Some(_)) => None,
            Ok(None) if full.is_file() => None,
            Ok(None) => error(
                format!("the data file `{rel}` does not exist"),
                "no such file",
                "text data is a file, a folder of `.txt` files, or a pattern such as `corpus/*.txt`, relative to the spec file's directory",
            ),
            Err(e) => error(e, "no text file here", "a folder's `.txt` files are read, or the files a pattern names"),
        },
        ("text" | "jsonl" | "parquet" | "arrow", "tokenizer") if full.is_dir() => (!full.join("tokenizer.json").is_file()).then(|| {
            Diagnostic::error("E0502", format!("the model folder `{rel}` has no tokenizer.json"), span, "no tokenizer.json")
                .with_help("a tokenizer is a `tokenizer.json` file or a model folder holding one (save it with `tokenizer.save_pretrained`)")
        }),
        _ if full.is_dir() => error(
            format!("the {what} file `{rel}` is a folder, not a file"),
            "a folder",
            "name the file itself (paths are relative to the spec file's directory)",
        ),
        _ if !full.is_file() => error(
            format!("the {what} file `{rel}` does not exist"),
            "no such file",
            "paths are relative to the spec file's directory",
        ),
        _ => None,
    }
}

fn lower_data(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Data> {
    if let Value::Str(_) = node.value {
        cx.choice(node, &["training", "data"])?;
        return Some(Data::Synthetic { task: Task::Classification, samples: None });
    }
    let f = cx.fields(node, &["training", "data"], owner)?;
    let kind = cx.required(&f, "kind", "training.data").and_then(|n| cx.choice(n, &["training", "data", "kind"]))?;
    // a key of another kind of data would be ignored: refused at its span
    for (key, kinds, what) in DATA_KEYS {
        if let (false, Some(span)) = (kinds.contains(&kind.as_str()), f.key_span(key)) {
            let only = kinds.iter().map(|k| format!("`kind: {k}`")).collect::<Vec<_>>().join(" or ");
            cx.push(
                Diagnostic::error(
                    "E0502",
                    format!("`{key}` does not apply to `{kind}` data"),
                    span,
                    format!("only for {only}"),
                )
                .with_help(format!("`{key}` {what}: use {only}, or remove it")),
            );
        }
    }
    match kind.as_str() {
        "synthetic" => {
            let task = match f.get("task") {
                None => Some(Task::Classification),
                Some(n) => cx.choose::<Task>(n, &["training", "data", "task"]),
            };
            let samples = match f.get("samples") {
                None => Some(None),
                Some(n) => cx.uint(n, rules::training_minimum("samples")).map(Some),
            };
            Some(Data::Synthetic { task: task?, samples: samples? })
        }
        file_kind => {
            let Some(p) = f.get("path") else {
                cx.push(
                    Diagnostic::error(
                        "E0502",
                        format!("`{file_kind}` data needs a `path`"),
                        f.key_span("kind").unwrap_or(owner),
                        "no `path` given",
                    )
                    .with_help("add `path: data/train.csv` (relative to the spec file)"),
                );
                return None;
            };
            let path = cx.string(p)?.to_string();
            if let Some(base) = cx.base_dir {
                for (what, node) in [("data", Some(p)), ("labels", f.get("labels")), ("tokenizer", f.get("tokenizer"))]
                {
                    let Some(node) = node else { continue };
                    let Some(rel) = node.as_str() else { continue };
                    let full = base.join(rel);
                    if file_kind == "images" && what == "data" {
                        if !full.exists() {
                            cx.push(
                                Diagnostic::error(
                                    "E0502",
                                    format!("the image folder (or CIFAR-10 batch file) `{rel}` does not exist"),
                                    node.span,
                                    "no such folder",
                                )
                                .with_help("an image folder holds one folder per class (`images/cat/1.png`); paths are relative to the spec file's directory"),
                            );
                            return None;
                        }
                    } else if let Some(d) = missing_file(file_kind, what, rel, &full, node.span) {
                        cx.push(d);
                        return None;
                    }
                }
            }
            if file_kind == "csv" {
                Some(Data::Csv { path, span: p.span })
            } else if matches!(file_kind, "text" | "jsonl" | "parquet" | "arrow") {
                // a model folder (the one `--init` takes) stands for its tokenizer.json
                let tokenizer = match f.get("tokenizer") {
                    Some(t) => {
                        let t = cx.string(t)?;
                        let folder = cx.base_dir.is_some_and(|b| b.join(t).is_dir());
                        Some(if folder { format!("{}/tokenizer.json", t.trim_end_matches('/')) } else { t.to_string() })
                    }
                    None => None,
                };
                use pipec_plan::datafile::RecordFormat;
                let (format, name_key) = match file_kind {
                    "jsonl" => (RecordFormat::Jsonl, "field"),
                    "parquet" => (RecordFormat::Parquet, "column"),
                    "arrow" => (RecordFormat::Arrow, "column"),
                    _ => return Some(Data::Text { path, tokenizer, span: p.span }),
                };
                let text = |cx: &mut Lower<'_>, key: &str| match f.get(key) {
                    Some(n) => cx.string(n).map(|s| Some(s.to_string())),
                    None => Some(None),
                };
                let field = text(cx, name_key)?.unwrap_or_else(|| "text".to_string());
                let eot = text(cx, "eot")?;
                Some(Data::Records { format, path, field, tokenizer, eot, span: p.span })
            } else if file_kind == "images" {
                let resize = match f.get("resize") {
                    None => Some(None),
                    Some(n) => cx.uint(n, 1).map(Some),
                };
                // per-channel values: any mean, a positive standard deviation
                let list = |cx: &mut Lower<'_>, key: &str, bound: rules::Bound| -> Option<Vec<f64>> {
                    let Some(n) = f.get(key) else { return Some(Vec::new()) };
                    let Value::Seq(items) = &n.value else {
                        cx.wrong_type(n, "a list of numbers, one per channel, like `[0.485, 0.456, 0.406]`");
                        return None;
                    };
                    items.iter().map(|i| cx.number(i, bound)).collect()
                };
                let (mean, std) =
                    (list(cx, "mean", rules::Bound::NonNegative), list(cx, "std", rules::Bound::Positive));
                let resize_span = f.get("resize").map(|n| n.span);
                Some(Data::Images { path, resize: resize?, resize_span, mean: mean?, std: std?, span: p.span })
            } else if file_kind == "tokens" {
                let npy = path.ends_with(".npy");
                let dtype = match f.get("dtype") {
                    Some(n) => Some(cx.choose::<pipec_plan::TokenDtype>(n, &["training", "data", "dtype"])?),
                    None if npy => None,
                    None => {
                        cx.push(
                            Diagnostic::error(
                                "E0502",
                                "a raw token file needs its integer type",
                                p.span,
                                "no `dtype` given",
                            )
                            .with_help("add `dtype: uint16` (2 bytes per token) or `dtype: uint32`; a `.npy` file says its own"),
                        );
                        return None;
                    }
                };
                Some(Data::Tokens { path, dtype, span: p.span })
            } else {
                let labels = f.get("labels").and_then(|l| cx.string(l)).map(str::to_string);
                Some(Data::Npy { path, labels, span: p.span })
            }
        }
    }
}
