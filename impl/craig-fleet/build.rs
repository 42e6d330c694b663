//! Embeds `migrations/<service>/*.sql` (what `sqlx::migrate!` did, without compiling sqlx's
//! macro crates and a second copy of its Postgres driver for the host: issue 12's build).
//! Writes `$OUT_DIR/migrations.rs`: per service, `(version, description, include_str!(file))`
//! in version order, parsed as sqlx's own resolver does (`<version>_<description>.sql`).

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir")).join("../../migrations");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut out = String::new();
    for service in ["cases", "financial", "rules", "security"] {
        let dir = root.join(service);
        println!("cargo:rerun-if-changed={}", dir.display());
        let mut files: Vec<(i64, String, PathBuf)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let (version, rest) = name.split_once('_')?;
                let description = rest.strip_suffix(".sql")?;
                let version: i64 = version.parse().unwrap_or_else(|_| panic!("{name}: the version prefix is not an integer"));
                Some((version, description.replace('_', " "), entry.path().canonicalize().expect("canonical path")))
            })
            .collect();
        files.sort();
        let _ = writeln!(out, "pub(crate) const {}: &[(i64, &str, &str)] = &[", service.to_uppercase());
        for (version, description, path) in files {
            let _ = writeln!(out, "    ({version}, {description:?}, include_str!({:?})),", path.display().to_string());
        }
        let _ = writeln!(out, "];");
    }
    let dest = PathBuf::from(std::env::var("OUT_DIR").expect("out dir")).join("migrations.rs");
    std::fs::write(dest, out).expect("writing migrations.rs");
}
