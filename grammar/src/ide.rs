//! Editor support computed from the source text alone: where the cursor is in the spec's
//! structure, hover documentation and completion candidates. The language server
//! (`pipec lsp`) turns these into LSP messages; they work on text that does not parse yet
//! (the structure is taken from indentation when the YAML is broken mid-edit).

use crate::layers::{layer_doc, JOINS, LAYERS};
use crate::schema::SchemaIndex;
use crate::span::Span;
use crate::yaml::{self, Node, Value};

/// What a completion inserts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionKind {
    Key,
    Value,
    Layer,
    /// A block defined under `model.blocks`.
    Block,
    /// A tensor named with `as` (or `input` / `in`).
    Tensor,
}

/// One completion candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub label: String,
    pub detail: String,
    pub kind: CompletionKind,
    pub insert: String,
}

/// The structural context of a position.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Context {
    /// Keys from the document root to the mapping the cursor is in.
    pub path: Vec<String>,
    /// The key whose value the cursor is in, if any.
    pub key: Option<String>,
    /// The word being typed (before the cursor).
    pub prefix: String,
    /// Whether the cursor is in a list item.
    pub list_item: bool,
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

/// The key a line opens (`  model:`, `- name: x` gives `name`), if any.
fn line_key(line: &str) -> Option<(String, bool)> {
    let t = line.trim_start();
    let (t, item) = match t.strip_prefix("- ") {
        Some(rest) => (rest, true),
        None => (t, false),
    };
    let colon = t.find(':')?;
    let key = &t[..colon];
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        return None;
    }
    Some((key.to_string(), item))
}

/// The context at byte `offset`, from indentation and the current line.
pub fn context(src: &str, offset: usize) -> Context {
    let offset = offset.min(src.len());
    let mut offset = offset;
    while !src.is_char_boundary(offset) {
        offset -= 1;
    }
    let line_start = src[..offset].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let before = &src[line_start..offset];
    let mut ctx = Context {
        prefix: before
            .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .next()
            .unwrap_or("")
            .to_string(),
        ..Context::default()
    };
    let trimmed = before.trim_start();
    ctx.list_item = trimmed.starts_with("- ") || trimmed == "-";
    let mut indent = indent_of(before);
    // Inside a flow mapping on this line: `device: { kind: cpu, mem|`
    let mut flow_path: Vec<String> = Vec::new();
    if let Some(open) = before.rfind('{') {
        if before[open..].find('}').is_none() {
            if let Some((k, _)) = line_key(&before[..open]) {
                flow_path.push(k);
            }
            let inner = &before[open + 1..];
            let part = inner.rsplit(',').next().unwrap_or("");
            if let Some(c) = part.find(':') {
                ctx.key = Some(part[..c].trim().to_string());
            }
        }
    }
    if flow_path.is_empty() {
        // `key: val|` on this line
        if let Some((k, _)) = line_key(before) {
            let after_colon = &before[before.find(':').map(|i| i + 1).unwrap_or(before.len())..];
            if !after_colon.is_empty() {
                ctx.key = Some(k);
            }
        }
        if ctx.list_item {
            indent += 2;
        }
    }
    // Walk up to collect the enclosing keys.
    let mut path: Vec<String> = Vec::new();
    let mut limit = if before.trim().is_empty() { indent_of(before) } else { indent };
    for line in src[..line_start].lines().rev() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let ind = indent_of(line);
        if ind < limit {
            if let Some((k, _)) = line_key(line) {
                let value = line[line.find(':').map(|i| i + 1).unwrap_or(line.len())..].trim();
                if value.is_empty() || value.starts_with('#') {
                    path.push(k);
                    limit = ind;
                    if ind == 0 {
                        break;
                    }
                    continue;
                }
            }
            limit = ind;
        }
    }
    path.reverse();
    path.extend(flow_path);
    ctx.path = path;
    ctx
}

/// The blocks defined under `model.blocks`, read from the text (so they complete while the
/// spec has errors): (name, header).
fn block_headers(src: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut blocks_indent: Option<usize> = None;
    let mut header_indent: Option<usize> = None;
    for line in src.lines() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let ind = indent_of(line);
        match blocks_indent {
            None => {
                if trimmed.starts_with("blocks:") {
                    blocks_indent = Some(ind);
                }
            }
            Some(b) if ind <= b => {
                blocks_indent = if trimmed.starts_with("blocks:") { Some(ind) } else { None };
                header_indent = None;
            }
            Some(_) => {
                let h = *header_indent.get_or_insert(ind);
                if ind == h && !trimmed.starts_with('-') {
                    if let Some(header) = trimmed.strip_suffix(':').or_else(|| trimmed.split_once(": ").map(|(k, _)| k))
                    {
                        let header = header.trim().trim_matches(|c| c == '"' || c == '\'');
                        let name: String =
                            header.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                        if !name.is_empty() {
                            out.push((name, header.to_string()));
                        }
                    }
                }
            }
        }
    }
    out
}

/// The names given with `as NAME` in `text`, in order.
fn tensor_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(" as ") {
        rest = &rest[i + 4..];
        let name: String = rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// Completion candidates at `offset`.
pub fn completions(src: &str, offset: usize, schema: &SchemaIndex) -> Vec<Completion> {
    let ctx = context(src, offset);
    let path: Vec<&str> = ctx.path.iter().map(String::as_str).collect();
    let mut out = Vec::new();
    // Layers, joins, blocks and tensor names inside `model.layers` and `model.blocks` items.
    if path.len() >= 2 && path[0] == "model" && (path[1] == "layers" || path[1] == "blocks") {
        let in_block = path[1] == "blocks";
        for l in LAYERS.iter().chain(JOINS) {
            if l.name.starts_with(&ctx.prefix) {
                out.push(Completion {
                    label: l.name.to_string(),
                    detail: l.signature.to_string(),
                    kind: CompletionKind::Layer,
                    insert: l.name.to_string(),
                });
            }
        }
        for (name, header) in block_headers(src) {
            if name.starts_with(&ctx.prefix) {
                out.push(Completion { label: name.clone(), detail: header, kind: CompletionKind::Block, insert: name });
            }
        }
        let reserved = if in_block { crate::graph::BLOCK_INPUT } else { crate::graph::MODEL_INPUT };
        let mut tensors: Vec<String> = vec![reserved.to_string()];
        let mut end = offset.min(src.len());
        while !src.is_char_boundary(end) {
            end -= 1;
        }
        for name in tensor_names(&src[..end]) {
            if !tensors.contains(&name) {
                tensors.push(name);
            }
        }
        for name in tensors {
            if name.starts_with(&ctx.prefix) {
                out.push(Completion {
                    label: name.clone(),
                    detail: "tensor".into(),
                    kind: CompletionKind::Tensor,
                    insert: name,
                });
            }
        }
        return out;
    }
    if let Some(key) = &ctx.key {
        let mut full: Vec<&str> = path.clone();
        full.push(key);
        for (v, doc) in schema.values_at(&full) {
            if v.starts_with(&ctx.prefix) {
                out.push(Completion { label: v.clone(), detail: doc, kind: CompletionKind::Value, insert: v });
            }
        }
        return out;
    }
    if let Some(doc) = schema.object_at(&path) {
        let present = present_keys(src, offset, &ctx);
        for (k, d) in doc.keys {
            if k.starts_with(&ctx.prefix) && !present.contains(&k) {
                out.push(Completion {
                    label: k.clone(),
                    detail: first_line(&d),
                    kind: CompletionKind::Key,
                    insert: format!("{k}: "),
                });
            }
        }
    }
    out
}

/// Keys already written at the same indentation in the same mapping.
fn present_keys(src: &str, offset: usize, ctx: &Context) -> Vec<String> {
    let line_start = src[..offset.min(src.len())].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line_end = src[offset.min(src.len())..].find('\n').map(|i| offset + i).unwrap_or(src.len());
    let indent = indent_of(&src[line_start..line_end]);
    let mut keys = Vec::new();
    let mut walk = |lines: &mut dyn Iterator<Item = &str>| {
        for line in lines {
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            let ind = indent_of(line);
            if ind < indent {
                break;
            }
            if ind == indent {
                if let Some((k, _)) = line_key(line) {
                    keys.push(k);
                }
            }
        }
    };
    walk(&mut src[..line_start].lines().rev());
    walk(&mut src[line_end.min(src.len())..].lines().skip(1));
    let _ = ctx;
    keys
}

fn first_line(doc: &str) -> String {
    doc.split(". ").next().unwrap_or(doc).trim_end_matches('.').to_string() + "."
}

/// Finds the deepest node (key or value) containing `offset`, with its key path.
fn find(node: &Node, offset: usize, path: &mut Vec<String>) -> Option<(Span, bool)> {
    match &node.value {
        Value::Map(entries) => {
            for (k, v) in entries {
                if k.span.start <= offset && offset <= k.span.end {
                    if let Some(name) = k.as_str() {
                        path.push(name.to_string());
                    }
                    return Some((k.span, true));
                }
                if v.span.start <= offset && offset <= v.span.end.max(v.span.start) {
                    if let Some(name) = k.as_str() {
                        path.push(name.to_string());
                    }
                    return find(v, offset, path).or(Some((v.span, false)));
                }
            }
            None
        }
        Value::Seq(items) => items
            .iter()
            .find(|i| i.span.start <= offset && offset <= i.span.end)
            .and_then(|i| find(i, offset, path).or(Some((i.span, false)))),
        _ => (node.span.start <= offset && offset <= node.span.end).then_some((node.span, false)),
    }
}

/// The word (identifier) around `offset` and its span.
fn word_at(src: &str, offset: usize) -> Option<(Span, &str)> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let offset = offset.min(src.len());
    if !src.is_char_boundary(offset) {
        return None;
    }
    // the word starts after the last non-word character, which may be several bytes long
    let start = src[..offset].char_indices().rfind(|&(_, c)| !is_word(c)).map_or(0, |(i, c)| i + c.len_utf8());
    let end = src[offset..].find(|c: char| !is_word(c)).map(|i| offset + i).unwrap_or(src.len());
    (start < end).then(|| (Span::new(start, end), &src[start..end]))
}

/// What `strategy.stages` means in words.
pub fn explain_stages(text: &str) -> Option<String> {
    match crate::dsl::parse_stages(text).ok()? {
        crate::dsl::StagesNotation::Straight => Some("`straight`: one unreplicated pipeline stage per device.".into()),
        crate::dsl::StagesNotation::Replicas(parts) => {
            let n: u64 = parts.iter().map(|p| p.0).sum();
            let per: Vec<String> =
                parts.iter().enumerate().map(|(i, p)| format!("stage {i} on {} worker(s)", p.0)).collect();
            Some(format!(
                "PipeDream notation `{text}`: {} stage(s) using {n} worker(s) (× tp): {}.",
                parts.len(),
                per.join(", ")
            ))
        }
    }
}

/// Hover documentation at `offset`: the key's documentation, a layer's signature, what a
/// strategy string means, or a schedule's description. `extra` is appended for the
/// strategy's layout and schedule values (the language server passes the last plan's
/// prediction and the other schedules' predictions).
pub fn hover(src: &str, offset: usize, schema: &SchemaIndex, extra: Option<&str>) -> Option<(Span, String)> {
    let (path, span, is_key) = match yaml::parse(src) {
        Ok(root) => {
            let mut path = Vec::new();
            let (span, is_key) = find(&root, offset, &mut path)?;
            (path, span, is_key)
        }
        Err(_) => {
            let ctx = context(src, offset);
            let (span, _) = word_at(src, offset)?;
            let mut path = ctx.path;
            if let Some(k) = ctx.key {
                path.push(k);
            }
            (path, span, false)
        }
    };
    let p: Vec<&str> = path.iter().map(String::as_str).collect();
    if !is_key && p.len() >= 2 && p[0] == "model" && (p[1] == "layers" || p[1] == "blocks") {
        let (wspan, word) = word_at(src, offset)?;
        if let Some(doc) = layer_doc(word).or_else(|| JOINS.iter().find(|j| j.name == word)) {
            return Some((wspan, format!("**{}**\n\n{}", doc.signature, doc.doc)));
        }
        if let Some((_, header)) = block_headers(src).into_iter().find(|(n, _)| n == word) {
            return Some((wspan, format!("**{header}**\n\nA block defined under `model.blocks`.")));
        }
        // a named tensor: its shape when the model checks
        let model = crate::check_source(src).spec.map(|s| s.model);
        let shape =
            model.and_then(|m| m.names.into_iter().find(|n| n.name == word && n.kind == crate::ast::NameKind::Tensor));
        return match shape {
            Some(n) => Some((wspan, format!("**{word}**: tensor {}", n.detail))),
            None if tensor_names(src).iter().any(|n| n == word) => Some((wspan, format!("**{word}**: a named tensor"))),
            None => None,
        };
    }
    if !is_key && p == ["strategy", "stages"] {
        let text = src.get(span.range())?.trim_matches(|c| c == '"' || c == '\'');
        let mut s = explain_stages(text)?;
        if let Some(e) = extra {
            s.push_str("\n\n");
            s.push_str(e);
        }
        return Some((span, s));
    }
    if !is_key {
        if let Some((wspan, word)) = word_at(src, offset) {
            if let Some((_, d)) = schema.values_at(&p).into_iter().find(|(v, d)| v == word && !d.is_empty()) {
                let mut s = format!("`{word}`: {d}");
                // the schedule: also the plan's prediction and the other schedules'
                if let (Some(e), true) = (extra, p.first() == Some(&"strategy") && p.get(1) == Some(&"schedule")) {
                    s.push_str("\n\n");
                    s.push_str(e);
                }
                return Some((wspan, s));
            }
        }
    }
    let doc = schema.doc_at(&p)?;
    let mut text = format!("**{}**\n\n{doc}", p.join("."));
    // the model's size, when it checks
    if p == ["model"] || p == ["model", "layers"] {
        if let Some(m) = crate::check_source(src).spec.map(|s| s.model) {
            text.push_str(&format!("\n\n{} (a weight tied to an embedding counted once)", m.parameters_text()));
        }
    }
    Some((span, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hover_never_panics_next_to_multibyte_characters() {
        let schema = SchemaIndex::default();
        for src in [
            "model:\n  layers:\n    - é linear(64, 10) → relu # ünïcode\n  loss: mse\n",
            "name: «run»\nstrategy:\n  stages: \"2–1\"\n  schedule: 1f1b\n",
            "strategy: {schedule: ✓gpipe}",
        ] {
            for offset in 0..=src.len() + 2 {
                let _ = hover(src, offset, &schema, None);
                let _ = completions(src, offset, &schema);
            }
            let after = src.find('é').or_else(|| src.find('»')).or_else(|| src.find('✓')).expect("a multibyte char");
            let next = after + src[after..].chars().next().map_or(1, char::len_utf8);
            assert!(word_at(src, next).is_none_or(|(s, w)| src.get(s.range()) == Some(w)));
        }
    }

    const SPEC: &str = "model:\n  input: [64]\n  layers:\n    - linear(64, 10) -> relu\n  loss: mse\nstrategy:\n  stages: \"2-1-1\"\n  schedule: 1f1b\n  \ncluster:\n  device: { kind: cpu, mem";

    #[test]
    fn context_from_indentation_and_flow_maps() {
        let at = SPEC.find("  \ncluster").expect("blank line") + 2;
        let c = context(SPEC, at);
        assert_eq!(c.path, vec!["strategy".to_string()]);
        let c = context(SPEC, SPEC.len());
        assert_eq!(c.path, vec!["cluster".to_string(), "device".to_string()]);
        assert_eq!(c.prefix, "mem");
    }

    #[test]
    fn completes_keys_values_and_layers() {
        let schema = SchemaIndex::default();
        let at = SPEC.find("  \ncluster").expect("blank line") + 2;
        let keys: Vec<String> = completions(SPEC, at, &schema).into_iter().map(|c| c.label).collect();
        assert!(keys.contains(&"microbatches".to_string()) && !keys.contains(&"schedule".to_string()), "{keys:?}");
        let c: Vec<String> = completions(SPEC, SPEC.len(), &schema).into_iter().map(|c| c.label).collect();
        assert_eq!(c, vec!["memory".to_string(), "memory_bandwidth".to_string()]);
        let src = "strategy:\n  schedule: zb";
        let v: Vec<String> = completions(src, src.len(), &schema).into_iter().map(|c| c.label).collect();
        assert!(v.contains(&"zb-h1".to_string()) && v.contains(&"zbv".to_string()), "{v:?}");
        let src = "model:\n  layers:\n    - lin";
        let l: Vec<String> = completions(src, src.len(), &schema).into_iter().map(|c| c.label).collect();
        assert_eq!(l, vec!["linear".to_string()]);
    }

    #[test]
    fn hovering_the_model_says_its_parameters() {
        let src = "model:\n  input: [16]\n  layers:\n    - embedding(100, 8) as t\n    - linear(8, 100, bias=false, tie=t)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 1us }\nstrategy:\n  stages: \"1\"\n  schedule: gpipe\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
        let schema = SchemaIndex::default();
        let (_, text) = hover(src, 2, &schema, None).expect("a hover on `model`");
        // the table once: 800, not 1,600
        assert!(text.contains("800 parameters (a weight tied to an embedding counted once)"), "{text}");
    }

    #[test]
    fn completes_and_hovers_blocks_and_tensor_names() {
        let schema = SchemaIndex::default();
        let src = "model:\n  input: [3, 8, 8]\n  blocks:\n    bottleneck(c, mid):\n      - conv2d(c, mid, k=1) as branch\n      - add(br";
        let c: Vec<(String, CompletionKind)> =
            completions(src, src.len(), &schema).into_iter().map(|c| (c.label, c.kind)).collect();
        assert_eq!(c, vec![("branch".to_string(), CompletionKind::Tensor)]);
        let src = "model:\n  input: [3, 8, 8]\n  blocks:\n    bottleneck(c, mid):\n      - conv2d(c, mid, k=1)\n  layers:\n    - conv2d(3, 8, k=1) as stem\n    - bot";
        let c: Vec<(String, String)> =
            completions(src, src.len(), &schema).into_iter().map(|c| (c.label, c.detail)).collect();
        assert_eq!(c, vec![("bottleneck".to_string(), "bottleneck(c, mid)".to_string())]);
        let at = src.len() - 1;
        let (_, text) = hover(&src.replace("- bot", "- bottleneck(8, 4)"), at, &schema, None).expect("hover");
        assert!(text.contains("bottleneck(c, mid)"), "{text}");
        let src = "model:\n  input: [3, 8, 8]\n  layers:\n    - conv2d(3, 8, k=1) as stem\n    - stem -> relu\n";
        let at = src.find("stem ->").expect("use") + 1;
        let (_, text) = hover(src, at, &schema, None).expect("hover");
        assert!(text.contains("stem"), "{text}");
    }

    #[test]
    fn hovers_keys_layers_and_strategies() {
        let schema = SchemaIndex::default();
        let src = "model:\n  input: [64]\n  layers:\n    - linear(64, 10) -> relu\n  loss: mse\nstrategy:\n  stages: \"2-1-1\"\n";
        let (_, h) = hover(src, src.find("linear").expect("layer") + 2, &schema, None).expect("hover");
        assert!(h.contains("linear(in, out, bias=true, tie=NAME)"), "{h}");
        let (_, h) =
            hover(src, src.find("2-1-1").expect("stages"), &schema, Some("predicted step 1 ms")).expect("hover");
        assert!(h.contains("3 stage(s) using 4 worker(s)") && h.contains("predicted step"), "{h}");
        let (_, h) = hover(src, src.find("loss").expect("key") + 1, &schema, None).expect("hover");
        assert!(h.contains("cross_entropy"), "{h}");
    }
}
