//! Models as graphs: named tensors, joins and blocks, expanded into the flat, topologically
//! ordered list of layers every later phase reads.
//!
//! The language (docs/spec.md, "The model language"):
//! - an item is a chain `call -> call -> ...`; its first call reads the previous item's
//!   output, or the tensor it starts from (`x -> conv2d(...)`), `input` being the model's
//!   input and `in` a block's input;
//! - `as NAME` after a call names its output (and labels the layer for partitions);
//! - `add(a, b, ...)` and `concat(a, b, ...)` join named tensors and start their item;
//! - `blocks:` defines `name(param, param=default): [items]`, called like a layer
//!   (`bottleneck(256, 64)`), its parameters usable as arguments inside; its output is its
//!   last item's; a labelled call (`bottleneck(...) as res2a`) labels its layers'
//!   range and prefixes the labels inside (`res2a.branch`).
//!
//! Every mistake is a spanned diagnostic; an error inside a block is reported once, at the
//! definition, with the call that reached it.

use std::collections::{HashMap, HashSet};

use pipec_plan::model::{fmt_shape, Op, Source};

use crate::ast::{Layer, LayerGroup, NameDef, NameKind, MAX_LAYERS};
use crate::cx::Lower;
use crate::diagnostic::{did_you_mean, Diagnostic};
use crate::dsl::{self, ArgValue, LayerCall};
use crate::layers::{layer_doc, resolve_call_warning, JOINS, LAYERS};
use crate::span::Span;
use crate::yaml::{Node, Value};

/// The name of the model's input tensor.
pub const MODEL_INPUT: &str = "input";
/// The name of a block's input tensor inside the block.
pub const BLOCK_INPUT: &str = "in";
/// How deeply block calls may nest. Expanding a call recurses, so without a bound a spec
/// of thousands of blocks each calling the next overflowed the stack (`pipec check` and
/// the language server died); real models nest a handful deep.
pub const MAX_BLOCK_DEPTH: usize = 64;

/// A block definition.
struct Block<'n> {
    name: String,
    span: Span,
    signature: String,
    params: Vec<(String, Option<ArgValue>, Span)>,
    body: &'n Node,
}

/// A tensor while expanding: where it comes from and its per-sample shape (None once an
/// error made it unknown).
#[derive(Debug, Clone)]
struct Tensor {
    source: Source,
    shape: Option<Vec<usize>>,
}

impl Tensor {
    fn unknown() -> Self {
        Tensor { source: Source::Input, shape: None }
    }
}

/// The names visible where an item is expanded.
struct Scope {
    tensors: HashMap<String, (Tensor, Span)>,
    params: HashMap<String, ArgValue>,
    /// Prefix of the labels given inside: "" at the top, `res2a.` inside a block call
    /// labelled `res2a`, None inside an unlabelled block call (no labels escape).
    label_prefix: Option<String>,
}

/// What the model's layers expand to.
pub(crate) struct Expanded {
    pub layers: Vec<Layer>,
    pub groups: Vec<LayerGroup>,
    pub names: Vec<NameDef>,
    pub ok: bool,
}

struct Expander<'c, 'a, 'n> {
    cx: &'c mut Lower<'a>,
    blocks: HashMap<String, Block<'n>>,
    used_blocks: HashSet<String>,
    layers: Vec<Layer>,
    groups: Vec<LayerGroup>,
    names: Vec<NameDef>,
    /// Per layer: whether anything reads its output.
    read: Vec<bool>,
    /// Blocks being expanded, with the call that entered each (innermost last).
    stack: Vec<(String, Span)>,
    /// Diagnostics already given for a span (a block expanded many times reports once).
    reported: HashSet<(Span, &'static str)>,
    ok: bool,
    overflow: bool,
}

/// Expands `layers` (with the `blocks` definitions, if any) from the model's input.
pub(crate) fn expand<'a, 'n>(
    cx: &mut Lower<'a>,
    layers: &'n Node,
    blocks: Option<&'n Node>,
    input: Option<&[usize]>,
) -> Expanded {
    let mut ex = Expander {
        cx,
        blocks: HashMap::new(),
        used_blocks: HashSet::new(),
        layers: Vec::new(),
        groups: Vec::new(),
        names: Vec::new(),
        read: Vec::new(),
        stack: Vec::new(),
        reported: HashSet::new(),
        ok: true,
        overflow: false,
    };
    if let Some(b) = blocks {
        ex.define_blocks(b);
    }
    let start = Tensor { source: Source::Input, shape: input.map(<[usize]>::to_vec) };
    let mut scope = Scope { tensors: HashMap::new(), params: HashMap::new(), label_prefix: Some(String::new()) };
    scope.tensors.insert(MODEL_INPUT.to_string(), (start.clone(), layers.span));
    let out = ex.items(layers, &mut scope, start);
    if out.shape.is_none() || input.is_none() {
        ex.ok = false;
    }
    if ex.ok {
        ex.unused();
    }
    let Expander { layers, groups, names, ok, .. } = ex;
    Expanded { layers, groups, names, ok }
}

fn is_join(name: &str) -> bool {
    JOINS.iter().any(|j| j.name == name)
}

impl<'n> Expander<'_, '_, 'n> {
    fn error(&mut self, d: Diagnostic) {
        self.ok = false;
        self.push(d);
    }

    /// Pushes a diagnostic once per (span, code), with the call that reached it when it is
    /// inside a block.
    fn push(&mut self, mut d: Diagnostic) {
        if !self.reported.insert((d.span(), d.code)) {
            return;
        }
        if let Some((name, call)) = self.stack.last() {
            d = d.with_label(*call, format!("in this call of `{name}`"));
        }
        self.cx.push(d);
    }

    // -------------------------------------------------------------------------------
    // Block definitions
    // -------------------------------------------------------------------------------

    fn define_blocks(&mut self, node: &'n Node) {
        let Value::Map(entries) = &node.value else {
            self.cx.wrong_type(node, "a mapping of block definitions like `conv_bn(cin, cout): [...]`");
            self.ok = false;
            return;
        };
        for (key, body) in entries {
            let text = key.as_str().unwrap_or("");
            let calls = match dsl::parse_chain(text) {
                Ok(c) => c,
                Err(e) => {
                    self.cx.dsl_error("E0309", key, &e, "block definition syntax error");
                    self.ok = false;
                    continue;
                }
            };
            let [header] = calls.as_slice() else {
                self.error(
                    Diagnostic::error(
                        "E0309",
                        "a block is defined as `name(param, ...)`, not a chain",
                        key.span,
                        "not a block header",
                    )
                    .with_help("e.g. `bottleneck(cin, mid, stride=1):` followed by the block's items"),
                );
                continue;
            };
            let name_span = self.cx.dsl_span(key, header.name_span);
            if let Some((_, l)) = &header.label {
                let span = self.cx.dsl_span(key, *l);
                self.error(Diagnostic::error(
                    "E0309",
                    "a block header takes no `as` label",
                    span,
                    "label the block's calls instead",
                ));
                continue;
            }
            if layer_doc(&header.name).is_some() || is_join(&header.name) {
                self.error(
                    Diagnostic::error(
                        "E0309",
                        format!("`{}` is a layer pipec knows; a block needs another name", header.name),
                        name_span,
                        "already a layer",
                    )
                    .with_help("rename the block"),
                );
                continue;
            }
            if let Some(first) = self.blocks.get(&header.name) {
                let first = first.span;
                self.error(
                    Diagnostic::error(
                        "E0309",
                        format!("the block `{}` is defined twice", header.name),
                        name_span,
                        "second definition",
                    )
                    .with_label(first, "first definition"),
                );
                continue;
            }
            let mut params: Vec<(String, Option<ArgValue>, Span)> = Vec::new();
            let mut good = true;
            for a in &header.args {
                let span = self.cx.dsl_span(key, a.span);
                let (name, default) = match (&a.key, &a.value) {
                    (None, ArgValue::Ident(p)) => (p.clone(), None),
                    (Some((k, _)), v) => (k.clone(), Some(v.clone())),
                    (None, v) => {
                        self.error(
                            Diagnostic::error(
                                "E0309",
                                format!("a block parameter is a name, found `{v}`"),
                                span,
                                "not a parameter name",
                            )
                            .with_help("write `name` or `name=default`"),
                        );
                        good = false;
                        continue;
                    }
                };
                if matches!(name.as_str(), "true" | "false" | MODEL_INPUT | BLOCK_INPUT)
                    || params.iter().any(|(p, _, _)| *p == name)
                {
                    self.error(Diagnostic::error(
                        "E0309",
                        format!("`{name}` cannot be a parameter here (reserved or given twice)"),
                        span,
                        "rename this parameter",
                    ));
                    good = false;
                    continue;
                }
                params.push((name, default, span));
            }
            if !matches!(body.value, Value::Seq(_)) {
                self.cx.wrong_type(body, "a list of the block's layer chains");
                self.ok = false;
                continue;
            }
            if good {
                let signature = text.trim().to_string();
                self.names.push(NameDef {
                    name: header.name.clone(),
                    kind: NameKind::Block,
                    span: name_span,
                    detail: signature.clone(),
                });
                self.blocks.insert(
                    header.name.clone(),
                    Block { name: header.name.clone(), span: name_span, signature, params, body },
                );
            }
        }
    }

    // -------------------------------------------------------------------------------
    // Items and chains
    // -------------------------------------------------------------------------------

    /// Expands a list of items from `current`; returns the last item's output.
    fn items(&mut self, list: &'n Node, scope: &mut Scope, mut current: Tensor) -> Tensor {
        let Value::Seq(items) = &list.value else {
            self.cx.wrong_type(list, "a list of layer chains");
            self.ok = false;
            return Tensor::unknown();
        };
        if items.is_empty() {
            self.error(Diagnostic::error("E0105", "no layers here", list.span, "add at least one layer"));
            return Tensor::unknown();
        }
        for item in items {
            let Some((repeat, chain_node, chain)) = self.parse_item(item) else {
                current = Tensor::unknown();
                continue;
            };
            let times = repeat.unwrap_or(1);
            for i in 0..times {
                let suffix = repeat.map(|_| i);
                current = self.chain(chain_node, &chain, scope, current, suffix);
                if self.overflow {
                    return Tensor::unknown();
                }
            }
        }
        current
    }

    /// `- chain` or `- repeat N: chain`: the repeat count, the node holding the chain's
    /// text, and the parsed calls.
    fn parse_item(&mut self, item: &'n Node) -> Option<(Option<u64>, &'n Node, Vec<LayerCall>)> {
        let (repeat, chain_node, chain) = match &item.value {
            Value::Str(text) => match dsl::parse_layer_item(text) {
                Ok(parsed) => (parsed.repeat.map(|r| r.0), item, parsed.chain),
                Err(e) => {
                    self.cx.dsl_error("E0301", item, &e, "layer syntax error");
                    self.ok = false;
                    return None;
                }
            },
            Value::Map(entries) if entries.len() == 1 => {
                let (k, v) = &entries[0];
                let key = k.as_str().unwrap_or("");
                let count = match dsl::parse_repeat_key(key) {
                    Some(Ok((n, _))) => n,
                    Some(Err(e)) => {
                        self.cx.dsl_error("E0301", k, &e, "layer syntax error");
                        self.ok = false;
                        return None;
                    }
                    None => {
                        self.error(
                            Diagnostic::error(
                                "E0301",
                                format!("a layer mapping must be `repeat N: ...`, found key `{key}`"),
                                k.span,
                                "expected `repeat N`",
                            )
                            .with_help("write the layer as a string, e.g. `- linear(784, 1024) -> relu`"),
                        );
                        return None;
                    }
                };
                let Some(text) = v.as_str() else {
                    self.cx.wrong_type(v, "a layer chain after `repeat N:`");
                    self.ok = false;
                    return None;
                };
                match dsl::parse_chain(text) {
                    Ok(chain) => (Some(count), v, chain),
                    Err(e) => {
                        self.cx.dsl_error("E0301", v, &e, "layer syntax error");
                        self.ok = false;
                        return None;
                    }
                }
            }
            _ => {
                self.cx.wrong_type(item, "a layer chain like `linear(784, 1024) -> relu`");
                self.ok = false;
                return None;
            }
        };
        if let Some(times) = repeat {
            if times == 0 || times > 100_000 {
                self.error(Diagnostic::error(
                    "E0105",
                    format!("repeat count {times} is out of range"),
                    item.span,
                    "must be between 1 and 100000",
                ));
                return None;
            }
        }
        Some((repeat, chain_node, chain))
    }

    /// Expands one chain from `current`; returns its output.
    fn chain(
        &mut self,
        node: &'n Node,
        calls: &[LayerCall],
        scope: &mut Scope,
        current: Tensor,
        suffix: Option<u64>,
    ) -> Tensor {
        let mut cur = current;
        for (k, call) in calls.iter().enumerate() {
            let span = self.cx.dsl_span(node, call.span);
            let name = call.name.as_str();
            let bare = call.args.is_empty() && !self.cx.src[span.start..span.end].contains('(');
            let known_layer = layer_doc(name).is_some();
            let is_block = self.blocks.contains_key(name);
            let (out, is_reference) = if bare && !known_layer && !self.blocks.contains_key(name) && !is_join(name) {
                (self.reference(node, call, scope, k == 0), true)
            } else if is_join(name) {
                (self.join(node, call, scope, k == 0), false)
            } else if self.blocks.contains_key(name) {
                (self.block_call(node, call, scope, cur, suffix), false)
            } else {
                (self.layer(node, call, scope, cur), false)
            };
            cur = out;
            if self.overflow {
                return Tensor::unknown();
            }
            if let Some((label, rel)) = &call.label {
                let label_span = self.cx.dsl_span(node, *rel);
                if is_reference {
                    self.error(Diagnostic::error(
                        "E0308",
                        format!("`{name}` is already a tensor's name; `as` names a layer's output"),
                        label_span,
                        "nothing new to name",
                    ));
                } else {
                    // a block call's label is its range's (`LayerGroup`), not its last layer's
                    self.name_output(label, label_span, scope, &cur, suffix, !is_block);
                }
            }
        }
        cur
    }

    /// A chain that starts from a named tensor: `x -> ...`.
    fn reference(&mut self, node: &Node, call: &LayerCall, scope: &Scope, first: bool) -> Tensor {
        let span = self.cx.dsl_span(node, call.name_span);
        if !first {
            let (code, msg) = if scope.tensors.contains_key(&call.name) || call.name == MODEL_INPUT {
                ("E0308", format!("the tensor `{}` can only start a chain: `- {} -> ...`", call.name, call.name))
            } else {
                ("E0302", format!("unknown layer `{}`", call.name))
            };
            let mut d = Diagnostic::error(code, msg, span, "here");
            if let Some(s) = did_you_mean(&call.name, self.callables()) {
                d = d.with_help(format!("did you mean `{s}`?"));
            }
            self.error(d);
            return Tensor::unknown();
        }
        // (`- x` alone is allowed: the item's output is x, e.g. to end a block on it)
        match self.lookup(&call.name, scope) {
            Some(t) => t,
            None => {
                let mut d = Diagnostic::error(
                    "E0307",
                    format!("`{}` is neither a layer nor a tensor defined above", call.name),
                    span,
                    "unknown name",
                );
                let mut candidates: Vec<&str> = self.callables().collect();
                candidates.extend(scope.tensors.keys().map(String::as_str));
                d = match did_you_mean(&call.name, candidates) {
                    Some(s) => d.with_help(format!("did you mean `{s}`?")),
                    None => d.with_help("name a layer's output with `as NAME` before using it"),
                };
                self.error(d);
                Tensor::unknown()
            }
        }
    }

    fn callables(&self) -> impl Iterator<Item = &str> + '_ {
        LAYERS.iter().chain(JOINS).map(|l| l.name).chain(self.blocks.keys().map(String::as_str))
    }

    /// The tensor a name refers to in `scope`, marking it read.
    fn lookup(&mut self, name: &str, scope: &Scope) -> Option<Tensor> {
        let t = scope.tensors.get(name).map(|(t, _)| t.clone())?;
        if let Source::Layer(i) = t.source {
            if let Some(r) = self.read.get_mut(i) {
                *r = true;
            }
        }
        Some(t)
    }

    /// `add(a, b, ...)` / `concat(a, b, ...)`.
    fn join(&mut self, node: &Node, call: &LayerCall, scope: &Scope, first: bool) -> Tensor {
        let span = self.cx.dsl_span(node, call.span);
        if !first {
            self.error(
                Diagnostic::error(
                    "E0308",
                    format!("`{}` takes the tensors it names, so it must start its item", call.name),
                    span,
                    "in the middle of a chain",
                )
                .with_help(format!(
                    "name the chain's output (`... as x`) and write `- {}(x, y)` as its own item",
                    call.name
                )),
            );
            return Tensor::unknown();
        }
        let mut operands: Vec<(Tensor, Span)> = Vec::new();
        let mut good = true;
        for a in &call.args {
            let aspan = self.cx.dsl_span(node, a.span);
            match (&a.key, &a.value) {
                (None, ArgValue::Ident(n)) => match self.lookup(n, scope) {
                    Some(t) => operands.push((t, aspan)),
                    None => {
                        let candidates: Vec<&str> = scope.tensors.keys().map(String::as_str).collect();
                        let mut d =
                            Diagnostic::error("E0307", format!("unknown tensor `{n}`"), aspan, "not defined above");
                        d = match did_you_mean(n, candidates) {
                            Some(s) => d.with_help(format!("did you mean `{s}`?")),
                            None => d.with_help("name a layer's output with `as NAME` before using it"),
                        };
                        self.error(d);
                        good = false;
                    }
                },
                _ => {
                    self.error(
                        Diagnostic::error(
                            "E0308",
                            format!("`{}` takes tensor names, found `{}`", call.name, a.value),
                            aspan,
                            "not a tensor name",
                        )
                        .with_help(format!("e.g. `{}(branch, in)`", call.name)),
                    );
                    good = false;
                }
            }
        }
        if good && operands.len() < 2 {
            self.error(
                Diagnostic::error(
                    "E0308",
                    format!("`{}` joins two or more tensors", call.name),
                    span,
                    format!("{} given", operands.len()),
                )
                .with_help(format!("e.g. `{}(branch, in)`", call.name)),
            );
            good = false;
        }
        if !good || operands.iter().any(|(t, _)| t.shape.is_none()) {
            return Tensor::unknown();
        }
        let op =
            if call.name == "add" { Op::Add { inputs: operands.len() } } else { Op::Concat { inputs: operands.len() } };
        let shapes: Vec<&[usize]> = operands.iter().map(|(t, _)| t.shape.as_deref().unwrap_or(&[])).collect();
        match op.join_shape(&shapes) {
            Ok(out) => {
                let input_shape = shapes[0].to_vec();
                let inputs = operands.iter().map(|(t, _)| t.source).collect();
                self.push_layer(op, span, inputs, input_shape, out)
            }
            Err(e) => {
                let code = if e.limit { "E0105" } else { "E0304" };
                let mut d = Diagnostic::error(
                    code,
                    format!("shape mismatch at `{}`: {}", call.name, e.message),
                    span,
                    "these operands",
                );
                for (t, aspan) in &operands {
                    d = d.with_label(*aspan, fmt_shape(t.shape.as_deref().unwrap_or(&[])));
                }
                let help = if call.name == "add" {
                    "a residual needs a projection when the shapes differ, e.g. `in -> conv2d(cin, cout, k=1, stride=2) -> batchnorm2d as short`"
                } else {
                    "concatenated feature maps must have the same height and width"
                };
                self.error(d.with_help(help));
                Tensor::unknown()
            }
        }
    }

    /// A layer reading `cur`.
    fn layer(&mut self, node: &Node, call: &LayerCall, scope: &Scope, cur: Tensor) -> Tensor {
        let call_span = self.cx.dsl_span(node, call.span);
        let mut call = substitute(call, &scope.params);
        // `tie=NAME`: weight tying with the embedding whose output is NAME
        let tie = match call.args.iter().position(|a| a.key.as_ref().is_some_and(|(k, _)| k == "tie")) {
            None => None,
            Some(k) => {
                let arg = call.args.remove(k);
                let aspan = self.cx.dsl_span(node, arg.value_span);
                let found = match &arg.value {
                    ArgValue::Ident(n) => self.lookup(n, scope),
                    _ => None,
                };
                match found {
                    Some(t) => Some((t, aspan)),
                    None => {
                        self.error(
                            Diagnostic::error(
                                "E0312",
                                format!(
                                    "`tie` names the embedding to tie to; `{}` is not a tensor defined above",
                                    arg.value
                                ),
                                aspan,
                                "not an embedding's output",
                            )
                            .with_help(
                                "name the embedding's output (`embedding(vocab, d) as tokens`) and write `tie=tokens`",
                            ),
                        );
                        return Tensor::unknown();
                    }
                }
            }
        };
        let out = self.untied_layer(node, &call, call_span, cur);
        if let (Some((t, aspan)), Source::Layer(i)) = (tie, out.source) {
            self.tie(i, &t, aspan);
        }
        out
    }

    /// Ties layer `i` (a linear layer) to the embedding that made `to`, or says why not.
    fn tie(&mut self, i: usize, to: &Tensor, aspan: Span) {
        let embedding = match to.source {
            Source::Layer(a) => match self.layers[a].op {
                Op::Embedding { vocab, dim, .. } => Some((a, vocab, dim)),
                _ => None,
            },
            Source::Input => None,
        };
        let problem = match (embedding, &self.layers[i].op) {
            (None, _) => Some("the tensor it names is not an embedding's output".to_string()),
            (Some(_), op) if !matches!(op, Op::Linear { .. }) => {
                Some(format!("only `linear` can be tied, not `{}`", op.name()))
            }
            (Some((_, vocab, dim)), Op::Linear { in_features, out_features, bias }) => {
                if (*in_features, *out_features) != (dim, vocab) {
                    Some(format!(
                        "the embedding's table is [{vocab}, {dim}], so the tied layer must be `linear({dim}, {vocab})`, not `linear({in_features}, {out_features})`"
                    ))
                } else if *bias {
                    Some("a tied output projection has no bias: add `bias=false`".to_string())
                } else {
                    None
                }
            }
            _ => None,
        };
        match (problem, embedding) {
            (None, Some((a, _, _))) => self.layers[i].tied = Some(a),
            (why, _) => {
                let why = why.unwrap_or_default();
                self.error(
                    Diagnostic::error("E0312", format!("cannot tie this layer: {why}"), aspan, "tied here")
                        .with_help("`linear(d, vocab, bias=false, tie=NAME)` after `embedding(vocab, d) as NAME`"),
                );
            }
        }
    }

    /// A layer reading `cur` (its call without `tie`).
    fn untied_layer(&mut self, node: &Node, call: &LayerCall, call_span: Span, cur: Tensor) -> Tensor {
        let shape = cur.shape.clone();
        let op = match resolve_call_warning(call, shape.as_deref()) {
            Ok((op, warnings)) => {
                for w in warnings {
                    let span = self.cx.dsl_span(node, w.span);
                    let mut d = Diagnostic::warning(w.code, w.message, span, w.label);
                    if let Some(h) = w.help {
                        d = d.with_help(h);
                    }
                    self.push(d);
                }
                op
            }
            Err(errs) => {
                for e in errs {
                    let span = self.cx.dsl_span(node, e.span);
                    let mut help = e.help;
                    if e.code == "E0302" {
                        if let Some(s) = did_you_mean(&call.name, self.callables()) {
                            help = Some(format!("did you mean `{s}`?"));
                        }
                    }
                    let mut d = Diagnostic::error(e.code, e.message, span, e.label);
                    if let Some(h) = help {
                        d = d.with_help(h);
                    }
                    self.error(d);
                }
                return Tensor::unknown();
            }
        };
        let Some(in_shape) = shape else {
            return Tensor::unknown();
        };
        if op.takes_token_ids() && !(self.layers.is_empty() && cur.source == Source::Input) {
            self.error(Diagnostic::error(
                "E0304",
                "`embedding` must be the first layer: it takes token ids",
                call_span,
                "not the first layer",
            ));
            return Tensor::unknown();
        }
        match op.output_shape(&in_shape) {
            Ok(out) => self.push_layer(op, call_span, vec![cur.source], in_shape, out),
            Err(e) => {
                let span = e
                    .argument
                    .and_then(|a| crate::layers::argument_of(call, a))
                    .map(|a| self.cx.dsl_span(node, a.value_span))
                    .unwrap_or(call_span);
                let index = self.layers.len();
                if e.limit {
                    self.error(
                        Diagnostic::error(
                            "E0105",
                            format!("layer {index} (`{}`) is too large: {}", call.name, e.message),
                            span,
                            format!("input here is {}", fmt_shape(&in_shape)),
                        )
                        .with_help("pipec plans up to 2^32 per dimension, 2^40 elements per sample per tensor and 2^40 parameters per layer"),
                    );
                    return Tensor::unknown();
                }
                let mut d = Diagnostic::error(
                    "E0304",
                    format!("shape mismatch at layer {index} (`{}`): {}", call.name, e.message),
                    span,
                    if span == call_span {
                        format!("input here is {}", fmt_shape(&in_shape))
                    } else {
                        "this argument".to_string()
                    },
                );
                if span != call_span {
                    d = d.with_label(call_span, format!("in this layer, whose input is {}", fmt_shape(&in_shape)));
                }
                d = d.with_help(shape_help(&op, &in_shape));
                self.error(d);
                Tensor::unknown()
            }
        }
    }

    fn push_layer(
        &mut self,
        op: Op,
        span: Span,
        inputs: Vec<Source>,
        input_shape: Vec<usize>,
        out: Vec<usize>,
    ) -> Tensor {
        if self.layers.len() >= MAX_LAYERS {
            if !self.overflow {
                self.error(
                    Diagnostic::error(
                        "E0105",
                        format!("the model grows past {MAX_LAYERS} layers here, more than pipec plans"),
                        span,
                        "too many layers",
                    )
                    .with_help(
                        "describe the model at block granularity (e.g. `transformer_block`) rather than layer by layer",
                    ),
                );
            }
            self.overflow = true;
            return Tensor::unknown();
        }
        for s in &inputs {
            if let Source::Layer(i) = s {
                if let Some(r) = self.read.get_mut(*i) {
                    *r = true;
                }
            }
        }
        let index = self.layers.len();
        self.layers.push(Layer { op, label: None, span, inputs, input_shape, output_shape: out.clone(), tied: None });
        self.read.push(false);
        Tensor { source: Source::Layer(index), shape: Some(out) }
    }

    /// A call of a block: its parameters bound, its items expanded from `cur`.
    fn block_call(
        &mut self,
        node: &'n Node,
        call: &LayerCall,
        scope: &Scope,
        cur: Tensor,
        suffix: Option<u64>,
    ) -> Tensor {
        let call_span = self.cx.dsl_span(node, call.span);
        let name = call.name.clone();
        if let Some(pos) = self.stack.iter().position(|(b, _)| *b == name) {
            let path: Vec<&str> = self.stack[pos..].iter().map(|(b, _)| b.as_str()).chain([name.as_str()]).collect();
            self.error(
                Diagnostic::error(
                    "E0310",
                    format!("the block `{name}` calls itself: {}", path.join(" → ")),
                    call_span,
                    "a cycle",
                )
                .with_help("blocks cannot be recursive: expand the repetition with `repeat N:`"),
            );
            return Tensor::unknown();
        }
        if self.stack.len() >= MAX_BLOCK_DEPTH {
            let outer = self.stack.first().map_or(name.as_str(), |(b, _)| b.as_str()).to_string();
            self.error(
                Diagnostic::error(
                    "E0313",
                    format!("block calls nest more than {MAX_BLOCK_DEPTH} deep here (from `{outer}` down to `{name}`)"),
                    call_span,
                    format!("call number {} in the nest", self.stack.len() + 1),
                )
                .with_help("flatten the blocks: a block can list several calls, and `repeat N:` repeats one"),
            );
            // the whole nest is unusable: stop expanding it rather than report every level
            self.overflow = true;
            return Tensor::unknown();
        }
        self.used_blocks.insert(name.clone());
        let call = substitute(call, &scope.params);
        let Some(block) = self.blocks.get(&name) else {
            return Tensor::unknown();
        };
        let (block_span, signature, body) = (block.span, block.signature.clone(), block.body);
        let params = block.params.clone();
        // bind the arguments
        let mut bound: Vec<Option<ArgValue>> = vec![None; params.len()];
        let mut positional = 0usize;
        let mut good = true;
        let mut errors = Vec::new();
        for a in &call.args {
            let aspan = self.cx.dsl_span(node, a.span);
            let slot = match &a.key {
                None => {
                    positional += 1;
                    if positional > params.len() {
                        errors.push(Diagnostic::error(
                            "E0309",
                            format!("the block `{name}` takes {} argument(s), got more", params.len()),
                            aspan,
                            "extra argument",
                        ));
                        good = false;
                        continue;
                    }
                    positional - 1
                }
                Some((k, _)) => match params.iter().position(|(p, _, _)| p == k) {
                    Some(s) => s,
                    None => {
                        let mut d = Diagnostic::error(
                            "E0309",
                            format!("the block `{name}` has no parameter `{k}`"),
                            aspan,
                            "unknown parameter",
                        );
                        if let Some(s) = did_you_mean(k, params.iter().map(|(p, _, _)| p.as_str())) {
                            d = d.with_help(format!("did you mean `{s}`? the block is `{signature}`"));
                        }
                        errors.push(d);
                        good = false;
                        continue;
                    }
                },
            };
            if bound[slot].is_some() {
                errors.push(Diagnostic::error(
                    "E0309",
                    format!("`{}` is given twice", params[slot].0),
                    aspan,
                    "given again",
                ));
                good = false;
                continue;
            }
            bound[slot] = Some(a.value.clone());
        }
        let mut values = HashMap::new();
        for ((p, default, _), v) in params.iter().zip(bound) {
            match v.or(default.clone()) {
                Some(v) => {
                    values.insert(p.clone(), v);
                }
                None => {
                    errors.push(Diagnostic::error(
                        "E0309",
                        format!("the block `{name}` is missing its argument `{p}`"),
                        call_span,
                        format!("needs `{p}`"),
                    ));
                    good = false;
                }
            }
        }
        for d in errors {
            self.error(d.with_label(block_span, format!("`{signature}` is defined here")));
        }
        if !good {
            return Tensor::unknown();
        }
        let label = call.label.as_ref().map(|(l, _)| l.clone());
        let label_prefix = match (&scope.label_prefix, &label) {
            (Some(prefix), Some(l)) => Some(match suffix {
                Some(i) => format!("{prefix}{l}.{i}."),
                None => format!("{prefix}{l}."),
            }),
            _ => None,
        };
        let mut inner = Scope { tensors: HashMap::new(), params: values, label_prefix };
        inner.tensors.insert(BLOCK_INPUT.to_string(), (cur.clone(), block_span));
        let first = self.layers.len();
        self.stack.push((name, call_span));
        let out = self.items(body, &mut inner, cur);
        self.stack.pop();
        if let (Some(prefix), Some(l)) = (&scope.label_prefix, &label) {
            if self.layers.len() > first {
                let full = match suffix {
                    Some(i) => format!("{prefix}{l}.{i}"),
                    None => format!("{prefix}{l}"),
                };
                let span = call.label.as_ref().map(|(_, r)| self.cx.dsl_span(node, *r)).unwrap_or(call_span);
                self.groups.push(LayerGroup { label: full, first, last: self.layers.len() - 1, span });
            }
        }
        out
    }

    /// `as NAME` after a call: names its output in the scope and labels the layer.
    fn name_output(
        &mut self,
        name: &str,
        span: Span,
        scope: &mut Scope,
        out: &Tensor,
        suffix: Option<u64>,
        label_layer: bool,
    ) {
        if name == MODEL_INPUT || name == BLOCK_INPUT {
            self.error(Diagnostic::error(
                "E0305",
                format!("`{name}` is reserved for the input"),
                span,
                "choose another name",
            ));
            return;
        }
        if layer_doc(name).is_some() || is_join(name) || self.blocks.contains_key(name) {
            self.error(Diagnostic::error(
                "E0305",
                format!("`{name}` is already a layer or block; a tensor needs another name"),
                span,
                "choose another name",
            ));
            return;
        }
        if let Some((_, first)) = scope.tensors.get(name) {
            // the same `as` in a repeated chain names each copy in turn
            if *first != span {
                let first = *first;
                self.error(
                    Diagnostic::error("E0305", format!("the name `{name}` is used twice"), span, "second use")
                        .with_label(first, "first use")
                        .with_help("give each layer its own name"),
                );
                return;
            }
        }
        scope.tensors.insert(name.to_string(), (out.clone(), span));
        if let Some(shape) = &out.shape {
            if !self.names.iter().any(|n| n.span == span) {
                self.names.push(NameDef {
                    name: name.to_string(),
                    kind: NameKind::Tensor,
                    span,
                    detail: fmt_shape(shape),
                });
            }
        }
        if let (Some(prefix), Source::Layer(i), true) = (&scope.label_prefix, out.source, label_layer) {
            let label = match suffix {
                Some(k) => format!("{prefix}{name}.{k}"),
                None => format!("{prefix}{name}"),
            };
            if let Some(l) = self.layers.get_mut(i) {
                l.label = Some(label);
            }
        }
    }

    /// Warnings for outputs nothing reads (a branch that goes nowhere) and blocks never
    /// called.
    fn unused(&mut self) {
        let last = self.layers.len().saturating_sub(1);
        let mut warned: HashSet<Span> = HashSet::new();
        for i in 0..self.layers.len() {
            if i == last || self.read[i] || !warned.insert(self.layers[i].span) {
                continue;
            }
            let l = &self.layers[i];
            let what = match &l.label {
                Some(label) => format!("`{label}`"),
                None => format!("the output of `{}`", l.op.name()),
            };
            self.cx.push(
                Diagnostic::warning("W0311", format!("{what} is never used"), l.span, "nothing reads this")
                    .with_help("join it with `add`/`concat`, or remove the branch"),
            );
        }
        let mut unused: Vec<(String, Span)> = self
            .blocks
            .values()
            .filter(|b| !self.used_blocks.contains(&b.name))
            .map(|b| (b.name.clone(), b.span))
            .collect();
        unused.sort_by_key(|(_, s)| s.start);
        for (name, span) in unused {
            self.cx.push(
                Diagnostic::warning("W0311", format!("the block `{name}` is never used"), span, "defined here")
                    .with_help("call it in `layers`, or remove it"),
            );
        }
    }
}

/// The call with its block parameters replaced by their values.
fn substitute(call: &LayerCall, params: &HashMap<String, ArgValue>) -> LayerCall {
    if params.is_empty() {
        return call.clone();
    }
    let mut c = call.clone();
    for a in &mut c.args {
        if let ArgValue::Ident(name) = &a.value {
            if let Some(v) = params.get(name) {
                a.value = v.clone();
            }
        }
    }
    c
}

/// The help of a shape mismatch at a layer: the call that fits the shape arriving.
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
        Op::TransformerBlock { d_model, heads, kv_heads, head_dim, causal, .. } if input.last() == Some(d_model) => {
            block_help(op, *d_model, *heads, *kv_heads, *head_dim, *causal)
        }
        _ => format!("the shape arriving here is {}", fmt_shape(input)),
    }
}

/// The fix for a transformer block's arguments that do not fit together, in the order
/// `Op::output_shape` checks them.
fn block_help(op: &Op, d_model: usize, heads: usize, written_kv: usize, written_head: usize, causal: bool) -> String {
    let Some(b) = op.block_dims() else { return String::new() };
    if heads == 0 || (written_head == 0 && !d_model.is_multiple_of(heads)) {
        return format!("heads must divide d={d_model}, or give each head its size with `head_dim=`");
    }
    if b.mla.is_some() && written_kv != 0 && written_kv != heads {
        return "remove `kv_heads`: multi-head latent attention's keys and values come from one latent".into();
    }
    if b.kv_heads == 0 || !heads.is_multiple_of(b.kv_heads) {
        let divisors: Vec<String> = (1..=heads).filter(|k| heads.is_multiple_of(*k)).map(|k| k.to_string()).collect();
        return format!("kv_heads must divide heads={heads}: one of {}", divisors.join(", "));
    }
    if b.rope != 0.0 {
        if let Some(m) = b.mla.filter(|m| m.rope_dim % 2 != 0) {
            return format!("give the rotary part an even size: rope_dim={}", m.rope_dim + 1);
        }
        if b.mla.is_none() && b.head_dim % 2 != 0 {
            if written_head > 0 {
                return format!("give the heads an even size: head_dim={}", b.head_dim + 1);
            }
            // the most heads up to these whose size is whole and even
            return match (1..heads).rev().find(|h| d_model.is_multiple_of(*h) && (d_model / h).is_multiple_of(2)) {
                Some(h) => format!("rotary embeddings need an even head size d/heads: heads={h} gives {}", d_model / h),
                None => format!("rotary embeddings need an even head size d/heads, and no head count below {heads} gives one for d={d_model}: give `head_dim=` an even size"),
            };
        }
    }
    if b.rope_scaling != pipec_plan::rope::RopeScaling::None {
        if b.rope == 0.0 {
            return "give the block rotary embeddings to scale (`rope=θ`: Llama 3.1's 500000), or remove `rope_scaling`"
                .into();
        }
        if b.rope_scaling.problem().is_some() {
            return "Llama 3.1's: rope_scaling=llama3, rope_factor=8, rope_low_freq=1, rope_high_freq=4, rope_original=8192; YaRN needs rope_original, the pretrained context".into();
        }
    }
    if b.mla.is_some_and(|m| m.kv_lora == 0 || m.v_head_dim == 0) {
        return "give multi-head latent attention's latent and value heads a size (DeepSeek-V3: kv_lora=512, v_head_dim=128)".into();
    }
    if b.mla.is_some() && b.qk_norm {
        return "remove `qk_norm`: multi-head latent attention's RMSNorms are over its query and key-value latents"
            .into();
    }
    if b.window > 0 && !causal {
        return "add `causal=true`, or remove `window` (a sliding window looks back from each position)".into();
    }
    if let Some(m) = op.moe().filter(|m| m.top_k == 0 || m.top_k > m.experts) {
        return format!("choose top_k from 1 to {}, or more experts", m.experts);
    }
    if let Some(m) = op.moe().filter(|m| !(1.0..=m.max_skew()).contains(&m.skew)) {
        return format!("skew is the busiest expert's share of the choices over the mean: from 1 to {}", m.max_skew());
    }
    String::new()
}
