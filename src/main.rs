//! The `specgate` command line: parses arguments and dispatches.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "specgate",
    version,
    about = "LLM serving gateway built around speculative decoding"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of one prompt and print it on stdout.
    Generate(specgate::generate::GenerateArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => specgate::generate::run(&args),
    }
}
