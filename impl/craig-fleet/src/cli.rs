//! The `craig-node` command line, callable as a library so the harness binary can run the
//! same node code as a child process of its own (`chaos craig-node …`).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use crate::node::{self, NodeOptions};
use crate::{Compat, CompatSet, Service};
use craig_mq::ServiceSettings;
use tokio_util::sync::CancellationToken;

/// Run one ADR-022 reference service: its HTTP routes, outbox worker and consumers.
///
/// Reads DATABASE_URL (the service's own database), AMQP_URL and CRAIG_JWT_SECRET, plus the
/// CRAIG_* worker settings documented in craig-mq's `settings` module. CRAIG_REPLICA, if set,
/// names this replica in the effects it records (the chaos harness sets it). SIGTERM or Ctrl-C
/// stops intake, drains the outbox once more and exits 0.
#[derive(Parser)]
#[command(name = "craig-node", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Service to run: cases, financial, rules or security.
    #[arg(long)]
    service: Option<Service>,
    /// HTTP listen address (port 0 picks a free port; the chosen one is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    http: SocketAddr,
    /// Reproduce a removed behaviour (repeatable), e.g. --compat pre-d2.
    #[arg(long = "compat", value_name = "MODE")]
    compat: Vec<Compat>,
}

#[derive(Subcommand)]
enum Command {
    /// Apply migrations/<service>/ to DATABASE_URL and exit.
    Migrate {
        #[arg(long)]
        service: Service,
        /// How long to keep retrying a database that is not up yet.
        #[arg(long, default_value = "30", value_name = "SECONDS")]
        wait: u64,
        /// Apply the schema a fleet on these compat modes had: the migrations of the
        /// amendments they revert are left out (e.g. pre-1179: no payments arbiter).
        #[arg(long = "compat", value_name = "MODE")]
        compat: Vec<Compat>,
    },
    /// Declare the whole fleet's broker topology on AMQP_URL and exit: the exchanges
    /// craig.events and craig.dlx, the DLQ craig-security.dlq, and every consumer queue with
    /// its bindings and DLX arguments. Idempotent; the deploy step before any node starts
    /// (publishes are mandatory, so an event with no queue yet stays pending). Run it with
    /// the operator's credential: no service account may declare the exchanges (#1202).
    Topology,
    /// Security's dead-letter tools (ADR-022 §D3, #1197).
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
    /// Print the rabbitmqctl commands that create each service's least-privilege account
    /// (ADR-022 #1202) on a vhost, and exit. Passwords are left for the operator to set.
    Access {
        /// The fleet's vhost.
        #[arg(long, default_value = "/")]
        vhost: String,
    },
}

#[derive(Subcommand)]
enum DlqAction {
    /// Re-read craig-security.dlq.capture once and record every captured dead letter the
    /// database now takes into dead_letter_audit (DATABASE_URL is security's database; its
    /// occurrence token keeps a redriven occurrence to one row). What it still refuses stays
    /// captured. Prints what it did (the running security node counts its own passes in
    /// dlq_outcomes_total; this one-off process has no /metrics); exits 1 when the database
    /// is unreachable.
    RedriveCapture,
}

/// Parse `args` (program name first) and run `craig-node` to completion.
pub fn run<I, T>(args: I) -> std::process::ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,sqlx=warn,lapin=warn,lapin::returned_messages=error".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    #[cfg(feature = "failpoints")]
    let _failpoints = craig_mq::crash::setup_from_env();
    if let Some(why) = failpoints_refusal(std::env::var_os("FAILPOINTS").as_deref(), cfg!(feature = "failpoints")) {
        eprintln!("craig-node: error: {why}");
        return std::process::ExitCode::from(2);
    }
    let cli = Cli::parse_from(args);
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(real_main(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("craig-node: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The operator's script for the service accounts of `craig_fleet::access` on `vhost`.
fn access_script(vhost: &str) -> String {
    let q = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let mut out = String::from("# ADR-022 #1202: one least-privilege account per service; export each CRAIG_<SERVICE>_AMQP_PASSWORD first.\n");
    for (_, user, p) in crate::access::accounts() {
        out.push_str(&format!("rabbitmqctl add_user {user} \"$CRAIG_{}_AMQP_PASSWORD\"\n", user.trim_start_matches("craig-").to_uppercase()));
        out.push_str(&format!(
            "rabbitmqctl set_permissions -p {} {user} {} {} {}\n",
            q(vhost),
            q(&p.configure),
            q(&p.write),
            q(&p.read)
        ));
    }
    out
}

/// Why this node must refuse to start with `fp` as its `FAILPOINTS` (None: it may start).
/// A crash point asked of a build that has none would silently never fire, and a chaos run
/// would come out green for the wrong reason.
fn failpoints_refusal(fp: Option<&std::ffi::OsStr>, built_with_failpoints: bool) -> Option<String> {
    let fp = fp.filter(|v| !v.is_empty())?;
    (!built_with_failpoints).then(|| {
        format!(
            "FAILPOINTS={} is set, but this craig-node was built without crash points \
             (cargo feature craig-fleet/failpoints); refusing to run a fault that can never fire",
            fp.to_string_lossy()
        )
    })
}

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    if let Some(Command::Access { vhost }) = &cli.command {
        print!("{}", access_script(vhost));
        return Ok(());
    }
    let settings = ServiceSettings::load().context("loading settings from the environment")?;
    if let Some(Command::Migrate { service, wait, compat }) = cli.command {
        node::migrate_for(service, &settings.database_url, Duration::from_secs(wait), &CompatSet::new(compat)).await?;
        println!("craig-node: migrations/{service} applied");
        return Ok(());
    }
    if let Some(Command::Dlq { action: DlqAction::RedriveCapture }) = cli.command {
        let pool = node::pool(&settings.database_url, 2)?;
        let handler = |d| {
            let pool = pool.clone();
            async move { crate::security::on_dead_letter(&pool, d, crate::security::RecorderMode::default()).await }
        };
        let r = craig_mq::dlq::redrive_capture(&settings.amqp_url, settings.publisher.heartbeat_secs, settings.queue_type, &handler, &CancellationToken::new())
            .await
            .map_err(|e| anyhow::anyhow!("{}", craig_mq::settings::redact_text(&e.to_string(), &settings.amqp_url)))?;
        pool.close().await;
        println!("craig-node: capture redrive: {} recorded, {} still refused and kept", r.redriven, r.kept);
        if r.unreachable {
            anyhow::bail!("security's database is unreachable; the rest of craig-security.dlq.capture waits (run it again)");
        }
        return Ok(());
    }
    if let Some(Command::Topology) = cli.command {
        let declared = node::declare_topology(&settings.amqp_url, true, settings.queue_type).await?;
        for spec in declared {
            println!("craig-node: declared {} ({}) <- craig.events [{}]", spec.queue, spec.queue_type, spec.bindings.join(", "));
        }
        println!("craig-node: declared craig.events, craig.dlx, craig-security.dlq ({}) <- craig.dlx [dlq.#]", settings.queue_type);
        return Ok(());
    }
    let service = cli.service.context("--service is required (cases, financial, rules or security)")?;
    let jwt_secret = std::env::var("CRAIG_JWT_SECRET")
        .ok()
        .filter(|s| !s.is_empty())
        .context("CRAIG_JWT_SECRET is not set; craig-node refuses to serve without a bearer key")?;
    let shutdown = CancellationToken::new();
    let signal_stop = shutdown.clone();
    tokio::spawn(async move {
        wait_for_stop_signal().await;
        tracing::info!(event = "node.stopping", "stop signal received; draining");
        signal_stop.cancel();
    });
    let opts = NodeOptions { service, http: cli.http, compat: CompatSet::new(cli.compat), settings, jwt_secret };
    node::run(opts, shutdown).await
}

async fn wait_for_stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::{access_script, failpoints_refusal};

    #[test]
    fn the_access_script_sets_every_account_with_quoted_regexes() {
        let out = access_script("/");
        assert!(out.contains("rabbitmqctl add_user craig-rules \"$CRAIG_RULES_AMQP_PASSWORD\""), "{out}");
        assert!(out.contains("rabbitmqctl set_permissions -p '/' craig-cases '^$' '^(craig\\.events)$' '^$'"), "{out}");
        assert_eq!(out.matches("set_permissions").count(), 4, "{out}");
    }
    use std::ffi::OsStr;

    #[test]
    fn a_build_without_crash_points_refuses_failpoints_and_names_the_feature() {
        let fp = Some(OsStr::new("outbox::after_publish_before_stamp=abort"));
        let why = failpoints_refusal(fp, false).expect("refused");
        assert!(why.contains("FAILPOINTS=outbox::after_publish_before_stamp=abort"), "{why}");
        assert!(why.contains("craig-fleet/failpoints"), "{why}");
        assert_eq!(failpoints_refusal(fp, true), None, "a build with crash points honours them");
        assert_eq!(failpoints_refusal(None, false), None);
        assert_eq!(failpoints_refusal(Some(OsStr::new("")), false), None, "empty means none asked");
    }
}
