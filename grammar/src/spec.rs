//! Lowering the spanned YAML tree into the typed spec ([`crate::ast`]), section by section.
//!
//! Lowering never stops at the first problem: each section is lowered on its own, each key
//! checked on its own, and every problem becomes a [`Diagnostic`]. A section that cannot be
//! lowered is `None`; later checks run on whatever sections are present.

use pipec_plan::model::{fmt_shape, Loss};
use pipec_plan::rules;

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
    let section = |cx: &mut Lower<'_>, key: &str| -> Option<(&Node, Span)> {
        let node = cx.required(&top, key, "spec")?;
        Some((node, top.key_span(key).unwrap_or(doc_start)))
    };
    out.model = section(&mut cx, "model").and_then(|(n, ks)| lower_model(&mut cx, n, ks));
    out.cluster = section(&mut cx, "cluster").and_then(|(n, ks)| lower_cluster(&mut cx, n, ks));
    let strategy_node = section(&mut cx, "strategy");
    out.training = section(&mut cx, "training").and_then(|(n, ks)| lower_training(&mut cx, n, ks));
    if let (Some(model), Some(training)) = (&out.model, &out.training) {
        check_batch_size(&mut cx, model, training);
    }
    if let (Some(model), Some(training), Some(base)) = (&out.model, &out.training, base_dir) {
        check_data_file(&mut cx, model, training, base);
    }
    out.strategy = strategy_node.and_then(|(n, ks)| {
        crate::strategy::lower_strategy(&mut cx, n, ks, out.model.as_ref(), out.cluster.as_ref(), out.training.as_ref())
    });
    out.diagnostics = cx.diags;
    out
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
        Data::Text { path, span } => Some((path, pipec_plan::datafile::TokenFile::Text, *span)),
        Data::Tokens { path, dtype: Some(d), span } => Some((path, pipec_plan::datafile::TokenFile::Raw(*d), *span)),
        Data::Tokens { path, dtype: None, span } => Some((path, pipec_plan::datafile::TokenFile::Npy, *span)),
        _ => None,
    };
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
            Data::Csv { path, span } => (pipec_plan::datafile::load_csv(&base.join(path), &expect, extent), *span),
            Data::Npy { path, labels, span } => {
                let labels = labels.as_ref().map(|l| base.join(l));
                (pipec_plan::datafile::load_npy(&base.join(path), labels.as_deref(), &expect, extent), *span)
            }
        }
    };
    if let Err(e) = result {
        let base_shown = format!("`{}/", base.display());
        cx.push(
            Diagnostic::error(
                "E0502",
                format!("the data does not fit the model: {}", e.replace(&base_shown, "`")),
                span,
                "this data file",
            )
            .with_help(format!(
                "`pipec check` reads the first {} MiB of a data file; `pipec run` reads and checks all of it",
                DATA_CHECK_BYTES >> 20
            )),
        );
    }
}

fn lower_model(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Model> {
    let f = cx.fields(node, &["model"], owner)?;
    let input_node = cx.required(&f, "input", "model");
    let layers_node = cx.required(&f, "layers", "model");
    let blocks_node = f.get("blocks");
    let loss_node = cx.required(&f, "loss", "model");
    let loss = loss_node.and_then(|n| cx.choose::<Loss>(n, &["model", "loss"]));

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
    let (input, expanded, loss) = (input?, expanded?, loss?);
    let crate::graph::Expanded { layers, groups, names, .. } = expanded;
    let loss_node = loss_node?;
    let model = Model {
        input_span: input_node.map(|n| n.span).unwrap_or(owner),
        layers_span: layers_node.map(|n| n.span).unwrap_or(owner),
        loss_span: loss_node.span,
        input,
        layers,
        loss,
        groups,
        names,
    };
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
                .with_help(format!("end the model with `linear(d, {vocab})` to score every token at every position")),
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

fn lower_link(cx: &mut Lower<'_>, node: &Node, owner: Span, level: &str) -> Option<Link> {
    let path = ["cluster", "links", level];
    let f = cx.fields(node, &path, owner)?;
    let section = format!("cluster.links.{level}");
    let bw = cx.required(&f, "bandwidth", &section).and_then(|n| cx.quantity(n, Dimension::Bandwidth, false));
    let lat = cx.required(&f, "latency", &section).and_then(|n| cx.quantity(n, Dimension::Time, true));
    Some(Link { bandwidth: bw?, latency: lat? })
}

fn lower_cluster(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Cluster> {
    let f = cx.fields(node, &["cluster"], owner)?;
    let nodes = cx.required(&f, "nodes", "cluster").and_then(|n| cx.uint(n, 1));
    let dpn_node = cx.required(&f, "devices_per_node", "cluster");
    let dpn = dpn_node.and_then(|n| cx.uint(n, 1));
    let device = cx.required(&f, "device", "cluster").and_then(|n| {
        let df = cx.fields(n, &["cluster", "device"], f.key_span("device").unwrap_or(owner))?;
        let kind = df.get("kind").and_then(|k| cx.string(k)).unwrap_or("device").to_string();
        let mem_node = cx.required(&df, "memory", "cluster.device");
        let mem = mem_node.and_then(|m| cx.quantity(m, Dimension::Bytes, false));
        let tp =
            cx.required(&df, "throughput", "cluster.device").and_then(|t| cx.quantity(t, Dimension::FlopRate, false));
        let overhead = match df.get("overhead") {
            None => Some(0.0),
            Some(o) => cx.quantity(o, Dimension::Time, true),
        };
        Some((kind, mem?, mem_node.map(|m| m.span).unwrap_or(owner), tp?, overhead?))
    });
    let links = cx.required(&f, "links", "cluster").and_then(|n| {
        let lf = cx.fields(n, &["cluster", "links"], f.key_span("links").unwrap_or(owner))?;
        let intra = cx
            .required(&lf, "intra_node", "cluster.links")
            .and_then(|l| lower_link(cx, l, lf.key_span("intra_node").unwrap_or(owner), "intra_node"));
        let inter_node = lf.get("inter_node");
        let inter =
            inter_node.and_then(|l| lower_link(cx, l, lf.key_span("inter_node").unwrap_or(owner), "inter_node"));
        Some((intra?, inter, inter_node.is_some(), f.key_span("links").unwrap_or(n.span)))
    });
    let (nodes, dpn, (kind, memory, memory_span, throughput, overhead), (intra, inter, inter_given, links_key)) =
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
        device_kind: kind,
        memory,
        memory_span,
        throughput,
        overhead,
        devices_span: dpn_node.map(|n| n.span).unwrap_or(node.span),
        intra_node: intra,
        inter_node: inter,
        span: node.span,
    })
}

fn lower_training(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Training> {
    let f = cx.fields(node, &["training"], owner)?;
    let batch_node = cx.required(&f, "batch_size", "training");
    let batch = batch_node.and_then(|n| cx.uint(n, rules::training_minimum("batch_size")));
    let steps = cx.required(&f, "steps", "training").and_then(|n| cx.uint(n, rules::training_minimum("steps")));
    let optimizer = cx
        .required(&f, "optimizer", "training")
        .and_then(|n| lower_optimizer(cx, n, f.key_span("optimizer").unwrap_or(owner)));
    let precision = match f.get("precision") {
        None => Some(Precision::Fp32),
        Some(n) => cx.choose::<Precision>(n, &["training", "precision"]),
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
                Some(Some(Checkpoint { every: every?, dir: dir? }))
            })
        }
    };
    Some(Training {
        batch_size: batch?,
        batch_span: batch_node.map(|n| n.span).unwrap_or(owner),
        steps: steps?,
        optimizer: optimizer?,
        precision: precision?,
        seed: seed?,
        data: data?,
        checkpoint: checkpoint?,
    })
}

fn lower_optimizer(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Optimizer> {
    let f = cx.fields(node, &["training", "optimizer"], owner)?;
    let kind = cx
        .required(&f, "kind", "training.optimizer")
        .and_then(|n| cx.choose::<OptimizerKind>(n, &["training", "optimizer", "kind"]));
    let lr = cx.required(&f, "lr", "training.optimizer").and_then(|n| cx.number(n, rules::optimizer_bound("lr")));
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
        OptimizerKind::Adam => {
            not_for(cx, &["momentum"], "adam");
            let b1 = opt_f(cx, "beta1", 0.9);
            let b2 = opt_f(cx, "beta2", 0.999);
            let eps = opt_f(cx, "eps", 1e-8);
            Some(Optimizer::Adam { lr: lr?, beta1: b1?, beta2: b2?, eps: eps?, weight_decay: wd? })
        }
        OptimizerKind::Sgd | OptimizerKind::Momentum => {
            not_for(cx, &["beta1", "beta2", "eps"], kind.name());
            let default_m = if kind == OptimizerKind::Momentum { 0.9 } else { 0.0 };
            let m = opt_f(cx, "momentum", default_m);
            Some(Optimizer::Sgd { lr: lr?, momentum: m?, weight_decay: wd? })
        }
    }
}

fn lower_data(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Data> {
    if let Value::Str(_) = node.value {
        cx.choice(node, &["training", "data"])?;
        return Some(Data::Synthetic { task: Task::Classification, samples: None });
    }
    let f = cx.fields(node, &["training", "data"], owner)?;
    let kind = cx.required(&f, "kind", "training.data").and_then(|n| cx.choice(n, &["training", "data", "kind"]))?;
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
                for (what, node) in [("data", Some(p)), ("labels", f.get("labels"))] {
                    let Some(node) = node else { continue };
                    let Some(rel) = node.as_str() else { continue };
                    let full = base.join(rel);
                    if !full.is_file() {
                        cx.push(
                            Diagnostic::error(
                                "E0502",
                                format!("the {what} file `{rel}` does not exist"),
                                node.span,
                                "no such file",
                            )
                            .with_help("paths are relative to the spec file's directory"),
                        );
                        return None;
                    }
                }
            }
            if file_kind == "csv" {
                Some(Data::Csv { path, span: p.span })
            } else if file_kind == "text" {
                Some(Data::Text { path, span: p.span })
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
