//! `refuse_staging`: a trigger on one service's table that refuses every Nth insert
//! (SQLSTATE 40001) for the hold (`duration_ms`): staging itself fails (issue 22.2).
//! Evidence: the inserts a sequence saw refused.

use anyhow::Context as _;

use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct RefuseStaging;

impl Room for RefuseStaging {
    /// The connection the trigger is dropped over.
    type Applied = sqlx::PgPool;

    fn supported(_: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        Ok(())
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<sqlx::PgPool> {
        if *target != FaultTarget::Database {
            return Err(not_supported(f));
        }
        let (svc, every, table) = (f.service.clone().expect("validated"), f.every.expect("validated"), f.refused_table().to_owned());
        let url = cx.backend.lock().await.endpoints().database_url(&svc).context("no database for the service")?.to_owned();
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await?;
        // A sequence counts every insert tried (nextval survives the rollback it causes):
        // its value is the evidence of how many were refused.
        for sql in [
            "CREATE SEQUENCE IF NOT EXISTS chaos_refuse_staging_seq".to_owned(),
            "ALTER SEQUENCE chaos_refuse_staging_seq RESTART".to_owned(),
            format!(
                "CREATE OR REPLACE FUNCTION chaos_refuse_staging() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                 IF nextval('chaos_refuse_staging_seq') % {every} = 0 THEN \
                 RAISE EXCEPTION 'chaos refuse_staging: this insert into {table} is refused' USING ERRCODE = '40001'; END IF; \
                 RETURN NEW; END $$"
            ),
            format!("DROP TRIGGER IF EXISTS chaos_refuse_staging ON {table}"),
            format!("CREATE TRIGGER chaos_refuse_staging BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION chaos_refuse_staging()"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
        }
        Ok(pool)
    }

    async fn heal(cx: &Cx, f: &Fault, _: &FaultTarget, pool: sqlx::PgPool) -> anyhow::Result<()> {
        let (svc, every, table) = (f.service.clone().expect("validated"), f.every.expect("validated"), f.refused_table().to_owned());
        // Healed first, whatever the evidence read says.
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TRIGGER IF EXISTS chaos_refuse_staging ON {table}"))).execute(&pool).await?;
        let tried: Option<i64> = sqlx::query_scalar("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM chaos_refuse_staging_seq")
            .fetch_optional(&pool)
            .await
            .ok()
            .flatten();
        pool.close().await;
        // A sequence that could not be read proves nothing (never "0 refused").
        let evidence = match tried {
            None => {
                tracing::warn!(service = %svc, "refuse_staging: its sequence could not be read: no evidence");
                None
            }
            Some(tried) => {
                let refused = tried / i64::from(every);
                (refused > 0).then(|| format!("{refused} of {tried} inserts into {svc}'s {table} refused"))
            }
        };
        cx.evidence(evidence);
        Ok(())
    }
}
