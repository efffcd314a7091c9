//! The typed spec, and its lowering from the spanned YAML tree.
//!
//! Lowering never stops at the first problem: each section is lowered on its own, each key
//! checked on its own, and every problem becomes a [`Diagnostic`]. A section that cannot be
//! lowered is `None`; later checks run on whatever sections are present.

use pipec_plan::model::{fmt_shape, Loss, Op};

use crate::diagnostic::{did_you_mean, Diagnostic};
use crate::dsl::{self, Dimension, DslError, LayerCall, Rel};
use crate::layers::resolve_call;
use crate::schema::SchemaIndex;
use crate::span::Span;
use crate::yaml::{Node, Value};

/// A fully checked spec. Every field carries the span of the YAML it came from where a later
/// phase may need to point back at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub name: Option<String>,
    pub model: Model,
    pub cluster: Cluster,
    pub strategy: Strategy,
    pub training: Training,
}

/// The model: per-sample input shape, the flattened list of layers, the loss.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub input: Vec<usize>,
    pub input_span: Span,
    pub layers: Vec<Layer>,
    pub layers_span: Span,
    pub loss: Loss,
    pub loss_span: Span,
}

impl Model {
    /// The per-sample output shape of the last layer.
    pub fn output_shape(&self) -> &[usize] {
        self.layers.last().map(|l| l.output_shape.as_slice()).unwrap_or(&self.input)
    }
    /// The vocabulary size when the model starts with an embedding (its input is token ids).
    pub fn token_vocab(&self) -> Option<usize> {
        match self.layers.first().map(|l| &l.op) {
            Some(Op::Embedding { vocab, .. }) => Some(*vocab),
            _ => None,
        }
    }
}

/// One operator of the model after `repeat` expansion.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    pub op: Op,
    /// The `as` label; inside `repeat N` the i-th copy is `label.i`.
    pub label: Option<String>,
    /// The span of the call in the spec.
    pub span: Span,
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
}

/// One link level of the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

/// The cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub devices_per_node: usize,
    pub device_kind: String,
    /// Bytes of memory per device.
    pub memory: f64,
    pub memory_span: Span,
    /// FLOP/s per device.
    pub throughput: f64,
    /// The span of `devices_per_node`, for "the cluster has N devices" labels.
    pub devices_span: Span,
    pub intra_node: Link,
    pub inter_node: Option<Link>,
    pub span: Span,
}

/// The most layers a model may expand to.
pub const MAX_LAYERS: usize = 1_000_000;
/// The largest cluster pipec plans.
pub const MAX_DEVICES: usize = 65_536;
/// The most (stage, microbatch) pairs a plan may have (one bound for specs and plan files).
pub use pipec_plan::plan::MAX_STAGE_MICROBATCHES;

impl Cluster {
    pub fn device_count(&self) -> usize {
        self.nodes * self.devices_per_node
    }
}

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    Gpipe,
    OneFOneB,
    Interleaved,
    PipeDream,
    TwoBw,
    Chimera,
    ZbH1,
    Zbv,
    DpOnly,
}

impl ScheduleKind {
    pub const ALL: [(ScheduleKind, &'static str); 9] = [
        (ScheduleKind::Gpipe, "gpipe"),
        (ScheduleKind::OneFOneB, "1f1b"),
        (ScheduleKind::Interleaved, "interleaved"),
        (ScheduleKind::PipeDream, "pipedream"),
        (ScheduleKind::TwoBw, "2bw"),
        (ScheduleKind::Chimera, "chimera"),
        (ScheduleKind::ZbH1, "zb-h1"),
        (ScheduleKind::Zbv, "zbv"),
        (ScheduleKind::DpOnly, "dp-only"),
    ];
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(k, _)| *k == self).map(|(_, n)| *n).unwrap_or("?")
    }
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == name).map(|(k, _)| *k)
    }
    /// Whether the backward is split into input- and weight-gradient passes (zero bubble).
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1 | ScheduleKind::Zbv)
    }
    /// Whether the schedule computes exactly what one device would (no stale weights).
    pub fn is_synchronous(self, sync: SyncMode) -> bool {
        match self {
            ScheduleKind::PipeDream | ScheduleKind::TwoBw => false,
            ScheduleKind::DpOnly => sync == SyncMode::Bsp,
            _ => true,
        }
    }
}

/// Synchronous or asynchronous data parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyncMode {
    Bsp,
    Asp,
}

/// Gradient reduction for data parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceMode {
    Ring,
    ParameterServer,
}

/// The schedule with its options.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// Model chunks per device (interleaved: ≥ 2; zbv: 2; others 1).
    pub virtual_stages: usize,
    pub sync: SyncMode,
    pub reduce: ReduceMode,
    pub staleness: usize,
    /// PipeDream's vertical sync.
    pub vertical_sync: bool,
    pub span: Span,
}

/// How layers are assigned to stages.
#[derive(Debug, Clone, PartialEq)]
pub enum Partition {
    Auto,
    Balanced,
    /// Half-open layer ranges, one per (virtual) stage, checked to cover every layer once.
    Explicit(Vec<std::ops::Range<usize>>),
}

/// The parallel layout and schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Strategy {
    /// Workers replicating each pipeline stage (PipeDream notation). With `partition: auto`
    /// this is the starting layout; the planner may choose another.
    pub replicas: Vec<usize>,
    /// Tensor-parallel degree inside each stage replica.
    pub tp: usize,
    pub schedule: Schedule,
    pub microbatches: usize,
    pub partition: Partition,
    pub recompute: bool,
    /// The span of the strategy's layout (`stages:` or `dp`/`pp`), for plan-level errors.
    pub layout_span: Span,
    /// Whether the user fixed the layout; with `partition: auto` and no layout the planner
    /// chooses the replication too.
    pub layout_fixed: bool,
    pub partition_span: Span,
    /// The span of the `microbatches` value (None when the key is absent: 1 microbatch).
    pub microbatches_span: Option<Span>,
    pub span: Span,
}

impl Strategy {
    pub fn stage_count(&self) -> usize {
        self.replicas.len()
    }
    pub fn devices_needed(&self) -> usize {
        self.replicas.iter().sum::<usize>() * self.tp
    }
    /// The PipeDream notation of the layout (`2-1-1`).
    pub fn notation(&self) -> String {
        self.replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
    }
}

/// The optimizer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    Sgd { lr: f64, momentum: f64, weight_decay: f64 },
    Adam { lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

impl Optimizer {
    pub fn lr(&self) -> f64 {
        match *self {
            Optimizer::Sgd { lr, .. } | Optimizer::Adam { lr, .. } => lr,
        }
    }
    /// Optimizer-state floats per parameter (momentum buffer, Adam moments).
    pub fn state_per_parameter(&self) -> usize {
        match *self {
            Optimizer::Sgd { momentum: 0.0, .. } => 0,
            Optimizer::Sgd { .. } => 1,
            Optimizer::Adam { .. } => 2,
        }
    }
}

/// Numeric precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// Synthetic task kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Task {
    Classification,
    Regression,
}

/// Training data.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    Synthetic { task: Task, samples: usize },
    Csv { path: String, span: Span },
    Npy { path: String, labels: Option<String>, span: Span },
}

/// Checkpointing.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub every: usize,
    pub dir: String,
}

/// The training set-up.
#[derive(Debug, Clone, PartialEq)]
pub struct Training {
    pub batch_size: usize,
    pub batch_span: Span,
    pub steps: usize,
    pub optimizer: Optimizer,
    pub precision: Precision,
    pub seed: u64,
    pub data: Data,
    pub checkpoint: Option<Checkpoint>,
}

// ---------------------------------------------------------------------------------------
// Lowering
// ---------------------------------------------------------------------------------------

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

/// A mapping node whose keys were checked against the schema.
pub(crate) struct Fields<'n> {
    entries: &'n [(Node, Node)],
    /// The span of the key that owns this mapping (for "missing key" labels).
    owner: Span,
}

impl<'n> Fields<'n> {
    pub(crate) fn get(&self, key: &str) -> Option<&'n Node> {
        self.entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }
    pub(crate) fn key_span(&self, key: &str) -> Option<Span> {
        self.entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(k, _)| k.span)
    }
}

pub(crate) struct Lower<'a> {
    pub src: &'a str,
    pub schema: &'a SchemaIndex,
    pub diags: Vec<Diagnostic>,
    /// The spec file's directory, when known: data paths are checked against it.
    pub base_dir: Option<&'a std::path::Path>,
}

impl<'a> Lower<'a> {
    pub(crate) fn new(src: &'a str, schema: &'a SchemaIndex) -> Self {
        Lower { src, schema, diags: Vec::new(), base_dir: None }
    }

    pub(crate) fn push(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    pub(crate) fn wrong_type(&mut self, node: &Node, expected: &str) {
        let found = node.value.kind_name();
        self.push(Diagnostic::error(
            "E0103",
            format!("expected {expected}, found {found}"),
            node.span,
            format!("expected {expected}"),
        ));
    }

    /// Checks that `node` is a mapping whose keys are all known at `path`.
    pub(crate) fn fields<'n>(&mut self, node: &'n Node, path: &[&str], owner: Span) -> Option<Fields<'n>> {
        let Some(entries) = node.as_map() else {
            let what = if path.is_empty() { "the spec".to_string() } else { format!("`{}`", path.join(".")) };
            let found = node.value.kind_name();
            let span = if node.span.is_empty() { owner } else { node.span };
            self.push(
                Diagnostic::error(
                    "E0103",
                    format!("{what} must be a mapping, found {found}"),
                    span,
                    "expected a mapping of keys",
                )
                .with_help(match self.schema.object_at(path) {
                    Some(doc) => {
                        format!("keys: {}", doc.keys.iter().map(|k| k.0.as_str()).collect::<Vec<_>>().join(", "))
                    }
                    None => "see docs/spec.md".into(),
                }),
            );
            return None;
        };
        let allowed = self.schema.object_at(path).unwrap_or_default();
        for (k, _) in entries {
            let Some(key) = k.as_str() else {
                self.push(Diagnostic::error(
                    "E0103",
                    format!("keys must be strings, found {}", k.value.kind_name()),
                    k.span,
                    "not a key name",
                ));
                continue;
            };
            if allowed.keys.iter().any(|(a, _)| a == key) {
                continue;
            }
            let where_ =
                if path.is_empty() { "at the top level".to_string() } else { format!("in `{}`", path.join(".")) };
            let mut d = Diagnostic::error("E0102", format!("unknown key `{key}` {where_}"), k.span, "unknown key");
            match did_you_mean(key, allowed.keys.iter().map(|(a, _)| a.as_str())) {
                Some(s) => {
                    d = d.with_help(format!("did you mean `{s}`?")).with_fix(format!("replace with `{s}`"), k.span, s);
                }
                None => {
                    let keys: Vec<&str> = allowed.keys.iter().map(|(a, _)| a.as_str()).collect();
                    d = d.with_help(format!("known keys {where_}: {}", keys.join(", ")));
                }
            }
            self.push(d);
        }
        Some(Fields { entries, owner })
    }

    /// A required key: reports E0104 at the owner when missing.
    pub(crate) fn required<'n>(&mut self, f: &Fields<'n>, key: &str, section: &str) -> Option<&'n Node> {
        let v = f.get(key);
        if v.is_none() {
            let doc = self.schema.doc_at(&[section, key]).or_else(|| {
                let path: Vec<&str> = section.split('.').chain(std::iter::once(key)).collect();
                self.schema.doc_at(&path)
            });
            let message = if section == "spec" {
                format!("the spec is missing the required section `{key}`")
            } else {
                format!("`{section}` is missing the required key `{key}`")
            };
            let mut d = Diagnostic::error("E0104", message, f.owner, format!("`{key}` is missing here"));
            if let Some(doc) = doc {
                d = d.with_help(format!("`{key}`: {}", first_sentence(&doc)));
            }
            self.push(d);
        }
        v
    }

    pub(crate) fn uint(&mut self, node: &Node, min: u64) -> Option<usize> {
        match &node.value {
            Value::Int(i) if *i >= min as i64 => usize::try_from(*i).ok(),
            Value::Int(i) => {
                self.push(Diagnostic::error(
                    "E0105",
                    format!("must be at least {min}, found {i}"),
                    node.span,
                    format!("must be ≥ {min}"),
                ));
                None
            }
            _ => {
                self.wrong_type(node, "an integer");
                None
            }
        }
    }

    pub(crate) fn float(&mut self, node: &Node, positive: bool) -> Option<f64> {
        let v = match &node.value {
            Value::Int(i) => *i as f64,
            Value::Float(f) => *f,
            _ => {
                self.wrong_type(node, "a number");
                return None;
            }
        };
        if !v.is_finite() || v < 0.0 || (positive && v == 0.0) {
            let want = if positive { "larger than 0" } else { "0 or larger" };
            self.push(Diagnostic::error(
                "E0105",
                format!("must be {want}, found {v}"),
                node.span,
                format!("must be {want}"),
            ));
            return None;
        }
        Some(v)
    }

    pub(crate) fn boolean(&mut self, node: &Node) -> Option<bool> {
        match node.value {
            Value::Bool(b) => Some(b),
            _ => {
                self.wrong_type(node, "`true` or `false`");
                None
            }
        }
    }

    pub(crate) fn string<'n>(&mut self, node: &'n Node) -> Option<&'n str> {
        match &node.value {
            Value::Str(s) => Some(s),
            _ => {
                self.wrong_type(node, "a string");
                None
            }
        }
    }

    /// One of a fixed set of names (taken from the schema at `path`).
    pub(crate) fn choice(&mut self, node: &Node, path: &[&str]) -> Option<String> {
        let allowed: Vec<String> = self.schema.values_at(path).into_iter().map(|v| v.0).collect();
        let Some(text) = node.scalar_text().filter(|_| !matches!(node.value, Value::Seq(_) | Value::Map(_))) else {
            self.wrong_type(node, &format!("one of {}", quote_list(&allowed)));
            return None;
        };
        if allowed.contains(&text) {
            return Some(text);
        }
        let mut d = Diagnostic::error(
            "E0105",
            format!("`{text}` is not a valid `{}`", path.last().unwrap_or(&"value")),
            node.span,
            format!("expected one of {}", quote_list(&allowed)),
        );
        if let Some(s) = did_you_mean(&text, allowed.iter().map(String::as_str)) {
            d = d.with_help(format!("did you mean `{s}`?")).with_fix(format!("replace with `{s}`"), node.span, s);
        }
        self.push(d);
        None
    }

    /// Maps a span relative to a DSL string to a file span.
    pub(crate) fn dsl_span(&self, node: &Node, rel: Rel) -> Span {
        dsl_file_span(self.src, node, rel)
    }

    pub(crate) fn dsl_error(&mut self, code: &'static str, node: &Node, e: &DslError, what: &str) {
        let span = self.dsl_span(node, (e.offset, e.offset + e.len));
        self.push(Diagnostic::error(
            code,
            format!("{what}: expected {}, found {}", e.expected, e.found),
            span,
            format!("expected {}", e.expected),
        ));
    }

    /// A quantity of the given dimension, in base units.
    pub(crate) fn quantity(&mut self, node: &Node, dim: Dimension, allow_zero: bool) -> Option<f64> {
        let text = match &node.value {
            Value::Str(s) => s.clone(),
            Value::Int(_) | Value::Float(_) => {
                self.push(
                    Diagnostic::error(
                        "E0201",
                        format!("`{}` has no unit", node.scalar_text().unwrap_or_default()),
                        node.span,
                        "missing unit",
                    )
                    .with_help(format!("write {}", dim.describe())),
                );
                return None;
            }
            _ => {
                self.wrong_type(node, dim.describe());
                return None;
            }
        };
        let q = match dsl::parse_quantity(&text) {
            Ok(q) => q,
            Err(e) => {
                let span = self.dsl_span(node, (e.offset, e.offset + e.len));
                self.push(
                    Diagnostic::error(
                        "E0201",
                        format!("malformed quantity `{text}`: expected {}", e.expected),
                        span,
                        format!("expected {}", e.expected),
                    )
                    .with_help(format!("write {}", dim.describe())),
                );
                return None;
            }
        };
        let unit_span = self.dsl_span(node, q.unit_span);
        match dsl::lookup_unit(&q.unit) {
            Some((d, factor)) if d == dim => {
                let v = q.number * factor;
                if v < 0.0 || (!allow_zero && v == 0.0) {
                    self.push(Diagnostic::error(
                        "E0203",
                        format!("{} must be larger than zero", dim.noun()),
                        node.span,
                        "out of range",
                    ));
                    return None;
                }
                Some(v)
            }
            Some((d, _)) => {
                self.push(
                    Diagnostic::error(
                        "E0202",
                        format!("expected {}, found {} `{}`", dim.noun(), d.noun(), q.unit),
                        unit_span,
                        format!("this is a unit of {}", d.noun()),
                    )
                    .with_help(format!("write {}", dim.describe())),
                );
                None
            }
            None => {
                let units = dsl::UNITS.iter().filter(|u| u.1 == dim).map(|u| u.0);
                let mut d = Diagnostic::error("E0201", format!("unknown unit `{}`", q.unit), unit_span, "unknown unit");
                match did_you_mean(&q.unit, units) {
                    Some(s) => {
                        d = d.with_help(format!("did you mean `{s}`?")).with_fix(
                            format!("replace with `{s}`"),
                            unit_span,
                            s,
                        )
                    }
                    None => d = d.with_help(format!("write {}", dim.describe())),
                }
                self.push(d);
                None
            }
        }
    }
}

/// Maps a span relative to a scalar's decoded text to a file span: exact when the source
/// holds the text verbatim (plain or simply quoted), else the whole scalar.
pub fn dsl_file_span(src: &str, node: &Node, rel: Rel) -> Span {
    let raw = src.get(node.span.range()).unwrap_or("");
    let Some(text) = node.as_str() else { return node.span };
    let base = if raw == text {
        Some(node.span.start)
    } else if raw.len() >= 2 && (raw.starts_with('"') || raw.starts_with('\'')) && &raw[1..raw.len() - 1] == text {
        Some(node.span.start + 1)
    } else {
        None
    };
    match base {
        Some(b) => {
            let len = rel.1.saturating_sub(rel.0).max(usize::from(rel.0 < text.len()));
            let len = if rel.0 < text.len() { len.min(text.len() - rel.0).max(1) } else { 0 };
            Span::new(b + rel.0, b + rel.0 + len)
        }
        None => node.span,
    }
}

fn first_sentence(doc: &str) -> String {
    let one_line = doc.replace('\n', " ");
    match one_line.find(". ") {
        Some(i) => one_line[..=i].to_string(),
        None => one_line,
    }
}

fn quote_list(items: &[String]) -> String {
    let q: Vec<String> = items.iter().map(|s| format!("`{s}`")).collect();
    match q.len() {
        0 => String::new(),
        1 => q[0].clone(),
        n => format!("{} or {}", q[..n - 1].join(", "), q[n - 1]),
    }
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
    out.name = top.get("name").and_then(|n| cx.string(n)).map(str::to_string);
    let section = |cx: &mut Lower<'_>, key: &str| -> Option<(&Node, Span)> {
        let node = cx.required(&top, key, "spec")?;
        Some((node, top.key_span(key).unwrap_or(doc_start)))
    };
    out.model = section(&mut cx, "model").and_then(|(n, ks)| lower_model(&mut cx, n, ks));
    out.cluster = section(&mut cx, "cluster").and_then(|(n, ks)| lower_cluster(&mut cx, n, ks));
    let strategy_node = section(&mut cx, "strategy");
    out.training = section(&mut cx, "training").and_then(|(n, ks)| lower_training(&mut cx, n, ks));
    out.strategy = strategy_node.and_then(|(n, ks)| {
        crate::strategy::lower_strategy(&mut cx, n, ks, out.model.as_ref(), out.cluster.as_ref(), out.training.as_ref())
    });
    out.diagnostics = cx.diags;
    out
}

fn lower_model(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Model> {
    let f = cx.fields(node, &["model"], owner)?;
    let input_node = cx.required(&f, "input", "model");
    let layers_node = cx.required(&f, "layers", "model");
    let loss_node = cx.required(&f, "loss", "model");
    let loss = loss_node.and_then(|n| cx.choice(n, &["model", "loss"])).map(|l| {
        if l == "mse" {
            Loss::Mse
        } else {
            Loss::CrossEntropy
        }
    });

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
        dims.into_iter().collect::<Option<Vec<usize>>>()
    });

    let layers = layers_node.and_then(|n| lower_layers(cx, n, input.as_deref()));
    let (input, layers, loss) = (input?, layers?, loss?);
    let loss_node = loss_node?;
    let model = Model {
        input_span: input_node.map(|n| n.span).unwrap_or(owner),
        layers_span: layers_node.map(|n| n.span).unwrap_or(owner),
        loss_span: loss_node.span,
        input,
        layers,
        loss,
    };
    // The loss needs a vector output; cross-entropy needs at least two classes.
    let out = model.output_shape();
    let last_span = model.layers.last().map(|l| l.span).unwrap_or(model.input_span);
    match loss {
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

/// A layer item before shape inference: the call, its file span, its label.
struct PendingCall<'n> {
    call: LayerCall,
    node: &'n Node,
    label: Option<(String, Span)>,
}

fn lower_layers(cx: &mut Lower<'_>, node: &Node, input: Option<&[usize]>) -> Option<Vec<Layer>> {
    let Value::Seq(items) = &node.value else {
        cx.wrong_type(node, "a list of layer chains");
        return None;
    };
    if items.is_empty() {
        cx.push(Diagnostic::error("E0105", "the model has no layers", node.span, "add at least one layer"));
        return None;
    }
    // `None` marks an item that did not parse: shapes are unknown after it.
    let mut pending: Vec<Option<PendingCall<'_>>> = Vec::new();
    let mut ok = true;
    for item in items {
        // `- chain` or `- repeat N: chain`
        let (repeat, chain_node, chain) = match &item.value {
            Value::Str(text) => match dsl::parse_layer_item(text) {
                Ok(parsed) => (parsed.repeat.map(|r| r.0), item, parsed.chain),
                Err(e) => {
                    cx.dsl_error("E0301", item, &e, "layer syntax error");
                    ok = false;
                    pending.push(None);
                    continue;
                }
            },
            Value::Map(entries) if entries.len() == 1 => {
                let (k, v) = &entries[0];
                let key = k.as_str().unwrap_or("");
                let count = match dsl::parse_repeat_key(key) {
                    Some(Ok((n, _))) => n,
                    Some(Err(e)) => {
                        cx.dsl_error("E0301", k, &e, "layer syntax error");
                        ok = false;
                        continue;
                    }
                    None => {
                        cx.push(
                            Diagnostic::error(
                                "E0301",
                                format!("a layer mapping must be `repeat N: ...`, found key `{key}`"),
                                k.span,
                                "expected `repeat N`",
                            )
                            .with_help("write the layer as a string, e.g. `- linear(784, 1024) -> relu`"),
                        );
                        ok = false;
                        continue;
                    }
                };
                let Some(text) = v.as_str() else {
                    cx.wrong_type(v, "a layer chain after `repeat N:`");
                    ok = false;
                    continue;
                };
                match dsl::parse_chain(text) {
                    Ok(chain) => (Some(count), v, chain),
                    Err(e) => {
                        cx.dsl_error("E0301", v, &e, "layer syntax error");
                        ok = false;
                        continue;
                    }
                }
            }
            _ => {
                cx.wrong_type(item, "a layer chain like `linear(784, 1024) -> relu`");
                ok = false;
                continue;
            }
        };
        let times = repeat.unwrap_or(1);
        if times == 0 || times > 100_000 {
            cx.push(Diagnostic::error(
                "E0105",
                format!("repeat count {times} is out of range"),
                item.span,
                "must be between 1 and 100000",
            ));
            ok = false;
            continue;
        }
        if (pending.len() as u64).saturating_add(times.saturating_mul(chain.len() as u64)) > MAX_LAYERS as u64 {
            cx.push(
                Diagnostic::error(
                    "E0105",
                    format!("the model grows past {MAX_LAYERS} layers here, more than pipec plans"),
                    item.span,
                    "too many layers",
                )
                .with_help(
                    "describe the model at block granularity (e.g. `transformer_block`) rather than layer by layer",
                ),
            );
            return None;
        }
        for i in 0..times {
            for call in &chain {
                let label = call.label.as_ref().map(|(l, r)| {
                    let name = if repeat.is_some() { format!("{l}.{i}") } else { l.clone() };
                    (name, cx.dsl_span(chain_node, *r))
                });
                pending.push(Some(PendingCall { call: call.clone(), node: chain_node, label }));
            }
        }
    }
    // Duplicate labels.
    let mut seen: std::collections::HashMap<String, Span> = std::collections::HashMap::new();
    for p in pending.iter().flatten() {
        if let Some((l, span)) = &p.label {
            if let Some(first) = seen.get(l) {
                if first != span {
                    cx.push(
                        Diagnostic::error("E0305", format!("the label `{l}` is used twice"), *span, "second use")
                            .with_label(*first, "first use")
                            .with_help("give each layer its own label"),
                    );
                    ok = false;
                }
            } else {
                seen.insert(l.clone(), *span);
            }
        }
    }
    // Resolve calls and infer shapes; after the first mismatch, shapes are unknown and only
    // argument errors are reported (no cascade of follow-on mismatches).
    let mut shape: Option<Vec<usize>> = input.map(<[usize]>::to_vec);
    let mut layers = Vec::with_capacity(pending.len());
    let mut reported: std::collections::HashSet<Span> = std::collections::HashSet::new();
    for (index, p) in pending.iter().enumerate() {
        let Some(p) = p else {
            shape = None;
            continue;
        };
        let call_span = cx.dsl_span(p.node, p.call.span);
        match resolve_call(&p.call, shape.as_deref()) {
            Err(errs) => {
                ok = false;
                if reported.insert(call_span) {
                    for e in errs {
                        let span = cx.dsl_span(p.node, e.span);
                        let mut d = Diagnostic::error(e.code, e.message, span, e.label);
                        if let Some(h) = e.help {
                            d = d.with_help(h);
                        }
                        cx.push(d);
                    }
                }
                shape = None;
            }
            Ok(op) => {
                let Some(in_shape) = shape.clone() else {
                    continue;
                };
                if index > 0 && op.takes_token_ids() {
                    cx.push(Diagnostic::error(
                        "E0304",
                        "`embedding` must be the first layer: it takes token ids",
                        call_span,
                        "not the first layer",
                    ));
                    ok = false;
                    shape = None;
                    continue;
                }
                match op.output_shape(&in_shape) {
                    Ok(out) => {
                        layers.push(Layer {
                            op,
                            label: p.label.as_ref().map(|l| l.0.clone()),
                            span: call_span,
                            input_shape: in_shape,
                            output_shape: out.clone(),
                        });
                        shape = Some(out);
                    }
                    Err(e) => {
                        ok = false;
                        let span = e
                            .argument
                            .and_then(|a| p.call.args.get(a))
                            .map(|a| cx.dsl_span(p.node, a.value_span))
                            .unwrap_or(call_span);
                        if reported.insert(call_span) {
                            let mut d = Diagnostic::error(
                                "E0304",
                                format!("shape mismatch at layer {index} (`{}`): {}", p.call.name, e.message),
                                span,
                                format!("input here is {}", fmt_shape(&in_shape)),
                            );
                            if span != call_span {
                                d = d.with_label(call_span, "in this layer");
                            }
                            d = d.with_help(shape_help(&op, &in_shape));
                            cx.push(d);
                        }
                        shape = None;
                    }
                }
            }
        }
    }
    if ok && input.is_some() {
        Some(layers)
    } else {
        None
    }
}

fn shape_help(op: &Op, input: &[usize]) -> String {
    match op {
        Op::Linear { .. } if input.len() > 1 && input.len() == 3 => {
            "add `flatten` before this layer to turn the feature map into a vector".into()
        }
        Op::Linear { out_features, .. } => format!(
            "the input has {} features: write `linear({}, {out_features})`",
            input.last().copied().unwrap_or(0),
            input.last().copied().unwrap_or(0)
        ),
        Op::Conv2d { out_channels, .. } if input.len() == 3 => {
            format!("the input has {} channels: write `conv2d({}, {out_channels}, ...)`", input[0], input[0])
        }
        Op::LayerNorm { .. } => "omit the argument: `layernorm` infers its size".into(),
        _ => format!("the shape arriving here is {}", fmt_shape(input)),
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
        Some((kind, mem?, mem_node.map(|m| m.span).unwrap_or(owner), tp?))
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
    let (nodes, dpn, (kind, memory, memory_span, throughput), (intra, inter, inter_given, links_key)) =
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
        devices_span: dpn_node.map(|n| n.span).unwrap_or(node.span),
        intra_node: intra,
        inter_node: inter,
        span: node.span,
    })
}

fn lower_training(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Training> {
    let f = cx.fields(node, &["training"], owner)?;
    let batch_node = cx.required(&f, "batch_size", "training");
    let batch = batch_node.and_then(|n| cx.uint(n, 1));
    let steps = cx.required(&f, "steps", "training").and_then(|n| cx.uint(n, 1));
    let optimizer = cx
        .required(&f, "optimizer", "training")
        .and_then(|n| lower_optimizer(cx, n, f.key_span("optimizer").unwrap_or(owner)));
    let precision = match f.get("precision") {
        None => Some(Precision::Fp32),
        Some(n) => cx.choice(n, &["training", "precision"]).map(|p| match p.as_str() {
            "bf16" => Precision::Bf16,
            "fp16" => Precision::Fp16,
            _ => Precision::Fp32,
        }),
    };
    let seed = match f.get("seed") {
        None => Some(0),
        Some(n) => cx.uint(n, 0).map(|s| s as u64),
    };
    let data = match f.get("data") {
        None => Some(Data::Synthetic { task: Task::Classification, samples: 0 }),
        Some(n) => lower_data(cx, n, f.key_span("data").unwrap_or(owner)),
    };
    let checkpoint = match f.get("checkpoint") {
        None => Some(None),
        Some(n) => {
            cx.fields(n, &["training", "checkpoint"], f.key_span("checkpoint").unwrap_or(owner)).and_then(|cf| {
                let every = cx.required(&cf, "every", "training.checkpoint").and_then(|e| cx.uint(e, 1));
                let dir = cf.get("dir").and_then(|d| cx.string(d)).unwrap_or("checkpoints").to_string();
                every.map(|every| Some(Checkpoint { every, dir }))
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
    let kind =
        cx.required(&f, "kind", "training.optimizer").and_then(|n| cx.choice(n, &["training", "optimizer", "kind"]));
    let lr = cx.required(&f, "lr", "training.optimizer").and_then(|n| cx.float(n, true));
    let opt_f = |cx: &mut Lower<'_>, key: &str, default: f64| match f.get(key) {
        None => Some(default),
        Some(n) => cx.float(n, false),
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
    match kind.as_str() {
        "adam" => {
            not_for(cx, &["momentum"], "adam");
            let b1 = opt_f(cx, "beta1", 0.9);
            let b2 = opt_f(cx, "beta2", 0.999);
            let eps = opt_f(cx, "eps", 1e-8);
            for (k, v) in [("beta1", b1), ("beta2", b2)] {
                if let (Some(v), Some(n)) = (v, f.get(k)) {
                    if v >= 1.0 {
                        cx.push(Diagnostic::error(
                            "E0501",
                            format!("`{k}` must be below 1, found {v}"),
                            n.span,
                            "must be in [0, 1)",
                        ));
                        return None;
                    }
                }
            }
            Some(Optimizer::Adam { lr: lr?, beta1: b1?, beta2: b2?, eps: eps?, weight_decay: wd? })
        }
        other => {
            not_for(cx, &["beta1", "beta2", "eps"], other);
            let default_m = if other == "momentum" { 0.9 } else { 0.0 };
            let m = opt_f(cx, "momentum", default_m);
            Some(Optimizer::Sgd { lr: lr?, momentum: m?, weight_decay: wd? })
        }
    }
}

fn lower_data(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Data> {
    if let Value::Str(_) = node.value {
        cx.choice(node, &["training", "data"])?;
        return Some(Data::Synthetic { task: Task::Classification, samples: 0 });
    }
    let f = cx.fields(node, &["training", "data"], owner)?;
    let kind = cx.required(&f, "kind", "training.data").and_then(|n| cx.choice(n, &["training", "data", "kind"]))?;
    match kind.as_str() {
        "synthetic" => {
            let task = match f.get("task") {
                None => Some(Task::Classification),
                Some(n) => cx.choice(n, &["training", "data", "task"]).map(|t| {
                    if t == "regression" {
                        Task::Regression
                    } else {
                        Task::Classification
                    }
                }),
            };
            let samples = match f.get("samples") {
                None => Some(0),
                Some(n) => cx.uint(n, 1),
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
            } else {
                let labels = f.get("labels").and_then(|l| cx.string(l)).map(str::to_string);
                Some(Data::Npy { path, labels, span: p.span })
            }
        }
    }
}
