//! Process-wide logging: one `tracing` subscriber, installed once at
//! startup, writing human-readable lines (the default) or one JSON object per
//! line to stderr, filtered by `RUST_LOG` (default `info`). stdout stays the
//! program's output (`specgate generate` prints its text there).
//!
//! Everything the program reports goes through `tracing` events with
//! structured fields; the per-request line has the target
//! [`REQUEST_TARGET`] so it can be filtered or routed on its own.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use tracing::Subscriber;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// The target of the one line logged per HTTP request
/// (`RUST_LOG=specgate::request=warn` silences it).
pub const REQUEST_TARGET: &str = "specgate::request";

/// The target of the one line logged per panic ([`log_panics`]).
pub const PANIC_TARGET: &str = "specgate::panic";

/// The filter used when `RUST_LOG` is unset or empty.
pub const DEFAULT_FILTER: &str = "info";

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event: time, level, target, message,
    /// then the fields as `key=value`.
    #[default]
    Text,
    /// One JSON object per line, the event's fields at the top level
    /// (`timestamp`, `level`, `target`, `message`, then each field), for log
    /// shippers.
    Json,
}

/// Errors of setting up logging.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// `RUST_LOG` holds something that is not a filter directive list.
    #[error("RUST_LOG={value:?} is not a valid filter: {source}")]
    Filter {
        value: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// `RUST_LOG` is not valid UTF-8.
    #[error("RUST_LOG is not valid UTF-8")]
    FilterNotUnicode,
    /// A global subscriber was installed before (init runs once per process).
    #[error("a global log subscriber is already installed")]
    AlreadyInstalled,
}

/// Installs the process-wide subscriber: `format` lines on stderr, filtered
/// by `RUST_LOG` (default [`DEFAULT_FILTER`]). Colours only for text on a
/// terminal, so redirected logs carry no escape codes.
///
/// Errors: a malformed or non-UTF-8 `RUST_LOG` (rather than silently
/// logging at a level the operator did not ask for); a second call.
pub fn init(format: LogFormat) -> Result<(), LoggingError> {
    let filter = filter_from_env()?;
    let ansi = format == LogFormat::Text && std::io::stderr().is_terminal();
    tracing::subscriber::set_global_default(build(format, filter, std::io::stderr, ansi))
        .map_err(|_| LoggingError::AlreadyInstalled)
}

/// The filter `RUST_LOG` asks for, or [`DEFAULT_FILTER`] when it is unset
/// or blank.
///
/// Errors: `RUST_LOG` does not parse or is not UTF-8.
pub fn filter_from_env() -> Result<EnvFilter, LoggingError> {
    match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(v) if !v.trim().is_empty() => {
            EnvFilter::try_new(&v).map_err(|source| LoggingError::Filter { value: v, source })
        }
        Ok(_) | Err(std::env::VarError::NotPresent) => Ok(EnvFilter::new(DEFAULT_FILTER)),
        Err(std::env::VarError::NotUnicode(_)) => Err(LoggingError::FilterNotUnicode),
    }
}

/// A subscriber writing `format` lines to `writer` through `filter`,
/// without colours: what [`init`] installs, for a caller that wants the
/// lines elsewhere (a test capturing them with [`Captured`]).
pub fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    build(format, filter, writer, false)
}

fn build<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => Box::new(b.finish()),
        // Fields at the top level: a shipper indexes `request_id` directly,
        // not `fields.request_id`.
        LogFormat::Json => Box::new(
            b.json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .finish(),
        ),
    }
}

/// Replaces the default panic message (several lines on stderr, outside
/// the log's format, which breaks a JSON log) with one `error` event of
/// target [`PANIC_TARGET`]: `thread`, `location` and `panic` (the message,
/// written escaped, so it stays one line in either format). For the
/// server's process; a panic caught per request (a 500) is logged this way
/// too. Tests keep the default hook, so their failures show as usual.
pub fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic without a message)");
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
        let thread = std::thread::current();
        tracing::error!(
            target: PANIC_TARGET,
            thread = thread.name().unwrap_or("<unnamed>"),
            location = location.as_deref(),
            panic = message,
            "a thread panicked"
        );
    }));
}

/// Installs the process-wide subscriber as JSON lines into a fresh
/// [`Captured`] buffer, filtered by `filter` (directives as in `RUST_LOG`):
/// for tests that check what a server logs from its runtime's threads.
///
/// Errors: `filter` does not parse; a subscriber is already installed.
pub fn capture_globally(filter: &str) -> Result<Captured, LoggingError> {
    let parsed = EnvFilter::try_new(filter).map_err(|source| LoggingError::Filter {
        value: filter.to_owned(),
        source,
    })?;
    let out = Captured::default();
    tracing::subscriber::set_global_default(subscriber(LogFormat::Json, parsed, out.clone()))
        .map_err(|_| LoggingError::AlreadyInstalled)?;
    Ok(out)
}

/// An in-memory log destination: every line written through it is kept
/// (cloning shares the buffer). For tests that check what was logged.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// Everything written so far (invalid UTF-8 replaced).
    pub fn contents(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What `log` writes in `format` at `filter`, on this thread.
    pub(crate) fn capture(format: LogFormat, filter: &str, log: impl FnOnce()) -> String {
        let out = Captured::default();
        let sub = subscriber(format, EnvFilter::new(filter), out.clone());
        tracing::subscriber::with_default(sub, log);
        out.contents()
    }

    /// The JSON lines `log` writes at `filter` (for the request-line tests).
    pub(crate) fn json_lines(filter: &str, log: impl FnOnce()) -> Vec<serde_json::Value> {
        capture(LogFormat::Json, filter, log)
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON log line"))
            .collect()
    }

    #[test]
    fn json_lines_parse_with_fields_at_the_top_level() {
        let out = capture(LogFormat::Json, "info", || {
            tracing::info!(target: REQUEST_TARGET, request_id = "abc", status = 200u16, "request");
            tracing::debug!("filtered out at info");
        });
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1, "{out}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(v["target"], REQUEST_TARGET);
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["request_id"], "abc");
        assert_eq!(v["status"], 200);
        assert_eq!(v["message"], "request");
    }

    #[test]
    fn text_lines_carry_key_value_fields_without_colour() {
        let out = capture(LogFormat::Text, "debug", || {
            tracing::debug!(request_id = "r-1", tokens = 3, "done");
        });
        assert!(out.contains("DEBUG"), "{out}");
        assert!(out.contains("request_id=\"r-1\""), "{out}");
        assert!(out.contains("tokens=3"), "{out}");
        assert!(!out.contains('\x1b'), "escape codes in {out:?}");
    }

    #[test]
    fn a_target_directive_filters_the_request_line() {
        let out = capture(LogFormat::Text, "info,specgate::request=warn", || {
            tracing::info!(target: REQUEST_TARGET, "request");
            tracing::info!("kept");
        });
        assert!(!out.contains("request"), "{out}");
        assert!(out.contains("kept"), "{out}");
    }

    #[test]
    fn the_format_flag_names_its_values() {
        use clap::ValueEnum;
        let names: Vec<String> = LogFormat::value_variants()
            .iter()
            .map(|v| v.to_possible_value().unwrap().get_name().to_string())
            .collect();
        assert_eq!(names, ["text", "json"]);
        assert_eq!(LogFormat::default(), LogFormat::Text);
    }
}
