//! `pipec lsp`: a language server over stdio. Diagnostics come from the same front end and
//! compiler as `pipec check` / `pipec compile` (one diagnostic model): front-end
//! diagnostics on every change, plan-level ones (memory, verifier) from a background thread
//! that waits for typing to pause and drops results for outdated document versions.
//!
//! Built on `lsp-server` (rust-analyzer's synchronous server crate): the front end is fast
//! and synchronous, so an async runtime would add weight without buying anything; the one
//! slow job (compiling the plan) runs on its own thread.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lsp_server::{Connection, ErrorCode, Message, Notification, Request, Response};
use lsp_types::notification::{
    DidChangeTextDocument, DidCloseTextDocument, DidOpenTextDocument, Notification as _, PublishDiagnostics,
};
use lsp_types::request::{CodeActionRequest, Completion, HoverRequest, Request as _};
use lsp_types::{
    CodeAction, CodeActionKind, CodeActionOrCommand, CodeActionParams, CodeActionProviderCapability, CompletionItem,
    CompletionItemKind, CompletionOptions, CompletionParams, CompletionResponse, Diagnostic as LspDiagnostic,
    DiagnosticRelatedInformation, DiagnosticSeverity, DidChangeTextDocumentParams, DidCloseTextDocumentParams,
    DidOpenTextDocumentParams, Hover, HoverContents, HoverParams, HoverProviderCapability, Location, MarkupContent,
    MarkupKind, NumberOrString, Position, PublishDiagnosticsParams, Range, ServerCapabilities,
    TextDocumentPositionParams, TextDocumentSyncCapability, TextDocumentSyncKind, TextEdit, Uri, WorkspaceEdit,
};
use pipec_grammar::ide;
use pipec_grammar::schema::SchemaIndex;
use pipec_grammar::{Diagnostic, LineIndex, Severity, Span};

use crate::{EXIT_OK, EXIT_USAGE};

/// The exit status of a server that ends without `shutdown` first (the LSP says 1).
const EXIT_ABNORMAL: u8 = 1;

/// How long typing must pause before the plan is compiled.
const DEBOUNCE: Duration = Duration::from_millis(300);

struct Doc {
    version: i32,
    text: String,
}

#[derive(Default)]
struct Shared {
    /// Latest version per document; results for older versions are dropped.
    latest: HashMap<String, i32>,
    /// The diagnostics last published per document (for code actions).
    published: HashMap<String, Vec<Diagnostic>>,
    /// The last plan's prediction per document (for hover on the strategy).
    prediction: HashMap<String, String>,
}

struct Job {
    uri: Uri,
    version: i32,
    text: String,
}

fn range(index: &LineIndex, src: &str, span: Span) -> Range {
    let (l0, c0) = index.utf16_position(src, span.start);
    let (l1, c1) = index.utf16_position(src, span.end);
    Range { start: Position { line: l0, character: c0 }, end: Position { line: l1, character: c1 } }
}

fn to_lsp(uri: &Uri, src: &str, index: &LineIndex, d: &Diagnostic) -> LspDiagnostic {
    let related: Vec<DiagnosticRelatedInformation> = d
        .labels
        .iter()
        .skip(1)
        .map(|l| DiagnosticRelatedInformation {
            location: Location { uri: uri.clone(), range: range(index, src, l.span) },
            message: l.message.clone(),
        })
        .collect();
    let mut message = d.message.clone();
    if let Some(h) = &d.help {
        message.push_str("\nhelp: ");
        message.push_str(h);
    }
    LspDiagnostic {
        range: range(index, src, d.span()),
        severity: Some(match d.severity {
            Severity::Error => DiagnosticSeverity::ERROR,
            Severity::Warning => DiagnosticSeverity::WARNING,
        }),
        code: Some(NumberOrString::String(d.code.to_string())),
        source: Some("pipec".into()),
        message,
        related_information: (!related.is_empty()).then_some(related),
        ..Default::default()
    }
}

fn publish(
    sender: &crossbeam_sender::Sender,
    shared: &Mutex<Shared>,
    uri: &Uri,
    version: i32,
    src: &str,
    diags: Vec<Diagnostic>,
) {
    let key = uri.as_str().to_string();
    let mut s = shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if s.latest.get(&key).copied() != Some(version) {
        return; // a newer version exists: this result is stale
    }
    let index = LineIndex::new(src);
    let params = PublishDiagnosticsParams {
        uri: uri.clone(),
        diagnostics: diags.iter().map(|d| to_lsp(uri, src, &index, d)).collect(),
        version: Some(version),
    };
    s.published.insert(key, diags);
    let _ = sender.send(Message::Notification(Notification::new(PublishDiagnostics::METHOD.to_string(), params)));
}

/// The sender type lsp-server uses.
mod crossbeam_sender {
    pub type Sender = crossbeam_channel::Sender<lsp_server::Message>;
}

/// The directory of a `file:` URI (percent-escapes decoded).
fn base_dir(uri: &Uri) -> Option<std::path::PathBuf> {
    let path = uri.as_str().strip_prefix("file://")?;
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Some(v) = path.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    let decoded = String::from_utf8(out).ok()?;
    std::path::Path::new(&decoded).parent().map(std::path::Path::to_path_buf)
}

/// Front-end diagnostics (fast, on every change).
fn front_end(src: &str, uri: &Uri) -> (Vec<Diagnostic>, Option<pipec_grammar::Spec>) {
    let dir = base_dir(uri);
    match std::panic::catch_unwind(AssertUnwindSafe(|| pipec_grammar::check_source_in(src, dir.as_deref()))) {
        Ok(r) => (r.diagnostics, r.spec),
        Err(_) => (Vec::new(), None),
    }
}

/// The hover compares the other schedules only when one compile takes less than this.
const COMPARE_BELOW: std::time::Duration = std::time::Duration::from_millis(100);

/// The background compiler: debounced, latest version per document only.
fn compiler_thread(jobs: Receiver<Job>, sender: crossbeam_sender::Sender, shared: Arc<Mutex<Shared>>) {
    let mut pending: HashMap<String, Job> = HashMap::new();
    loop {
        let first = if pending.is_empty() {
            match jobs.recv() {
                Ok(j) => Some(j),
                Err(_) => return,
            }
        } else {
            None
        };
        if let Some(j) = first {
            pending.insert(j.uri.as_str().to_string(), j);
        }
        // Wait for a pause in typing; newer versions replace older ones.
        loop {
            match jobs.recv_timeout(DEBOUNCE) {
                Ok(j) => {
                    pending.insert(j.uri.as_str().to_string(), j);
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        for (key, job) in pending.drain() {
            let current = shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner).latest.get(&key).copied();
            if current != Some(job.version) {
                continue;
            }
            let (mut diags, spec) = front_end(&job.text, &job.uri);
            let Some(spec) = spec else { continue };
            let started = std::time::Instant::now();
            let compiled = std::panic::catch_unwind(AssertUnwindSafe(|| {
                let options =
                    pipec_compiler::CompileOptions { source: Some(job.text.as_str().into()), ..Default::default() };
                pipec_compiler::compile(&spec, &options)
            }));
            match compiled.map(|r| (r.compiled, r.diagnostics)) {
                Ok((Some(c), plan_diagnostics)) => {
                    let sim = &c.plan.simulation;
                    let headroom = c.plan.memory_headroom();
                    let summary = format!(
                        "Plan: layout `{}`, {} schedule; predicted step {}, bubble {:.1}%, tightest memory headroom {:.1}%.",
                        c.plan.partition,
                        c.plan.schedule.kind,
                        pipec_compiler::render::human_time(sim.step_time_s),
                        sim.bubble_fraction * 100.0,
                        headroom * 100.0
                    );
                    // the other schedules side by side, when compiling is cheap (nine compiles)
                    let cheap = started.elapsed() < COMPARE_BELOW;
                    let summary = match cheap.then(|| {
                        std::panic::catch_unwind(AssertUnwindSafe(|| {
                            crate::compare_cmd::compare(&job.text, base_dir(&job.uri).as_deref(), None, &[])
                        }))
                    }) {
                        Some(Ok(Ok(rows))) => format!("{summary}\n\n{}", crate::compare_cmd::markdown(&rows)),
                        _ => summary,
                    };
                    shared
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .prediction
                        .insert(key.clone(), summary);
                    diags.extend(plan_diagnostics);
                }
                Ok((None, d)) => diags.extend(d),
                Err(_) => {}
            }
            publish(&sender, &shared, &job.uri, job.version, &job.text, diags);
        }
    }
}

fn respond<T: serde::Serialize>(conn: &Connection, id: lsp_server::RequestId, result: Result<T, String>) {
    let resp = match result {
        Ok(v) => Response::new_ok(id, v),
        Err(e) => Response::new_err(id, ErrorCode::InternalError as i32, e),
    };
    let _ = conn.sender.send(Message::Response(resp));
}

/// The open document a position names, its line index and the byte offset of the position.
fn locate<'a>(docs: &'a HashMap<String, Doc>, at: &TextDocumentPositionParams) -> Option<(&'a Doc, LineIndex, usize)> {
    let doc = docs.get(at.text_document.uri.as_str())?;
    let index = LineIndex::new(&doc.text);
    let offset = offset(&index, &doc.text, at.position);
    Some((doc, index, offset))
}

/// The byte offset of an LSP (UTF-16) position.
fn offset(index: &LineIndex, text: &str, pos: Position) -> usize {
    index.offset_of_utf16(text, pos.line, pos.character)
}

fn handle_request(
    conn: &Connection,
    req: Request,
    docs: &HashMap<String, Doc>,
    shared: &Mutex<Shared>,
    schema: &SchemaIndex,
) {
    let id = req.id.clone();
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| -> Result<serde_json::Value, String> {
        match req.method.as_str() {
            HoverRequest::METHOD => {
                let p: HoverParams = serde_json::from_value(req.params).map_err(|e| e.to_string())?;
                let Some((doc, index, offset)) = locate(docs, &p.text_document_position_params) else {
                    return Ok(serde_json::Value::Null);
                };
                let uri = p.text_document_position_params.text_document.uri;
                let extra = shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .prediction
                    .get(uri.as_str())
                    .cloned();
                Ok(match ide::hover(&doc.text, offset, schema, extra.as_deref()) {
                    None => serde_json::Value::Null,
                    Some((span, text)) => serde_json::to_value(Hover {
                        contents: HoverContents::Markup(MarkupContent { kind: MarkupKind::Markdown, value: text }),
                        range: Some(range(&index, &doc.text, span)),
                    })
                    .map_err(|e| e.to_string())?,
                })
            }
            Completion::METHOD => {
                let p: CompletionParams = serde_json::from_value(req.params).map_err(|e| e.to_string())?;
                let Some((doc, _, offset)) = locate(docs, &p.text_document_position) else {
                    return Ok(serde_json::Value::Null);
                };
                let items: Vec<CompletionItem> = ide::completions(&doc.text, offset, schema)
                    .into_iter()
                    .map(|c| CompletionItem {
                        label: c.label,
                        detail: Some(c.detail),
                        kind: Some(match c.kind {
                            ide::CompletionKind::Key => CompletionItemKind::PROPERTY,
                            ide::CompletionKind::Value => CompletionItemKind::ENUM_MEMBER,
                            ide::CompletionKind::Layer => CompletionItemKind::FUNCTION,
                            ide::CompletionKind::Block => CompletionItemKind::MODULE,
                            ide::CompletionKind::Tensor => CompletionItemKind::VARIABLE,
                        }),
                        insert_text: Some(c.insert),
                        ..Default::default()
                    })
                    .collect();
                serde_json::to_value(CompletionResponse::Array(items)).map_err(|e| e.to_string())
            }
            CodeActionRequest::METHOD => {
                let p: CodeActionParams = serde_json::from_value(req.params).map_err(|e| e.to_string())?;
                let uri = p.text_document.uri;
                let Some(doc) = docs.get(uri.as_str()) else { return Ok(serde_json::Value::Null) };
                let index = LineIndex::new(&doc.text);
                let (start, end) = (offset(&index, &doc.text, p.range.start), offset(&index, &doc.text, p.range.end));
                let published = shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .published
                    .get(uri.as_str())
                    .cloned()
                    .unwrap_or_default();
                let mut actions = Vec::new();
                for d in &published {
                    let Some(fix) = &d.fix else { continue };
                    // offered on the diagnostic and on the text the fix rewrites
                    let touches = |span: Span| span.end >= start && span.start <= end;
                    let edits = fix.edits();
                    if !touches(d.span()) && !edits.iter().any(|(span, _)| touches(*span)) {
                        continue;
                    }
                    let edits: Vec<TextEdit> = edits
                        .into_iter()
                        .map(|(span, new_text)| TextEdit { range: range(&index, &doc.text, span), new_text })
                        .collect();
                    // lsp-types keys a WorkspaceEdit by Uri, which clippy counts as mutable
                    #[allow(clippy::mutable_key_type)]
                    let mut changes = HashMap::new();
                    changes.insert(uri.clone(), edits);
                    actions.push(CodeActionOrCommand::CodeAction(CodeAction {
                        title: fix.title.clone(),
                        kind: Some(CodeActionKind::QUICKFIX),
                        diagnostics: Some(vec![to_lsp(&uri, &doc.text, &index, d)]),
                        edit: Some(WorkspaceEdit { changes: Some(changes), ..Default::default() }),
                        is_preferred: Some(true),
                        ..Default::default()
                    }));
                }
                serde_json::to_value(actions).map_err(|e| e.to_string())
            }
            other => Err(format!("unsupported request {other}")),
        }
    }));
    match outcome {
        Ok(Ok(v)) => respond(conn, id, Ok(v)),
        Ok(Err(e)) if e.starts_with("unsupported") => {
            let _ = conn.sender.send(Message::Response(Response::new_err(id, ErrorCode::MethodNotFound as i32, e)));
        }
        Ok(Err(e)) => respond::<()>(conn, id, Err(e)),
        Err(_) => respond::<()>(conn, id, Err("internal error while handling the request".into())),
    }
}

/// Runs the server until the client shuts it down.
pub fn run() -> u8 {
    let (conn, io) = crate::lsp_io::stdio();
    let caps = ServerCapabilities {
        text_document_sync: Some(TextDocumentSyncCapability::Kind(TextDocumentSyncKind::FULL)),
        hover_provider: Some(HoverProviderCapability::Simple(true)),
        completion_provider: Some(CompletionOptions {
            trigger_characters: Some(vec![":".into(), " ".into(), "-".into()]),
            ..Default::default()
        }),
        code_action_provider: Some(CodeActionProviderCapability::Simple(true)),
        ..Default::default()
    };
    let caps = match serde_json::to_value(caps) {
        Ok(c) => c,
        Err(_) => return EXIT_USAGE,
    };
    if let Err(e) = conn.initialize(caps) {
        eprintln!("error: language server initialisation failed: {e}");
        return EXIT_USAGE;
    }
    let shared = Arc::new(Mutex::new(Shared::default()));
    let (jobs_tx, jobs_rx): (Sender<Job>, Receiver<Job>) = channel();
    {
        let sender = conn.sender.clone();
        let shared = shared.clone();
        std::thread::spawn(move || compiler_thread(jobs_rx, sender, shared));
    }
    let schema = SchemaIndex::default();
    let mut docs: HashMap<String, Doc> = HashMap::new();
    let on_text = |uri: Uri, version: i32, text: String, docs: &mut HashMap<String, Doc>| {
        let key = uri.as_str().to_string();
        shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner).latest.insert(key.clone(), version);
        let (diags, spec) = front_end(&text, &uri);
        publish(&conn.sender, &shared, &uri, version, &text, diags);
        if spec.is_some() {
            let _ = jobs_tx.send(Job { uri, version, text: text.clone() });
        }
        docs.insert(key, Doc { version, text });
    };
    // LSP: `exit` after `shutdown` ends with 0, any other end (an `exit` without
    // `shutdown`, the client closing stdin) with 1
    let mut exit_code = EXIT_ABNORMAL;
    for msg in &conn.receiver {
        match msg {
            Message::Request(req) => {
                match conn.handle_shutdown(&req) {
                    Ok(true) => {
                        exit_code = EXIT_OK;
                        break;
                    }
                    Ok(false) => {}
                    Err(_) => break,
                }
                handle_request(&conn, req, &docs, &shared, &schema);
            }
            Message::Notification(n) => match n.method.as_str() {
                DidOpenTextDocument::METHOD => {
                    if let Ok(p) = serde_json::from_value::<DidOpenTextDocumentParams>(n.params) {
                        on_text(p.text_document.uri, p.text_document.version, p.text_document.text, &mut docs);
                    }
                }
                DidChangeTextDocument::METHOD => {
                    if let Ok(p) = serde_json::from_value::<DidChangeTextDocumentParams>(n.params) {
                        // Full synchronisation: the last change holds the whole text.
                        if let Some(change) = p.content_changes.into_iter().last() {
                            let newer = docs
                                .get(p.text_document.uri.as_str())
                                .is_none_or(|d| p.text_document.version >= d.version);
                            if newer {
                                on_text(p.text_document.uri, p.text_document.version, change.text, &mut docs);
                            }
                        }
                    }
                }
                DidCloseTextDocument::METHOD => {
                    if let Ok(p) = serde_json::from_value::<DidCloseTextDocumentParams>(n.params) {
                        let key = p.text_document.uri.as_str().to_string();
                        docs.remove(&key);
                        let mut s = shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        s.latest.remove(&key);
                        s.published.remove(&key);
                        let params = PublishDiagnosticsParams {
                            uri: p.text_document.uri,
                            diagnostics: Vec::new(),
                            version: None,
                        };
                        let _ = conn.sender.send(Message::Notification(Notification::new(
                            PublishDiagnostics::METHOD.to_string(),
                            params,
                        )));
                    }
                }
                "exit" => break,
                _ => {}
            },
            Message::Response(_) => {}
        }
    }
    drop(jobs_tx);
    drop(conn);
    io.join();
    exit_code
}
