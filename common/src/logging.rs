//! Log set-up shared by the binaries and examples: `tracing` to stderr, filtered by `RUST_LOG` (else `default`),
//! with colours only when stderr is a terminal so that logs written to files stay plain text.

/// Installs the global `tracing` subscriber; `default` is the filter used when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
