-- ADR-022 §D1/§D2 use `DEFAULT uuidv7()`, built into PostgreSQL 18. Older servers (15 here)
-- get an equivalent SQL function so the table DDL stays verbatim. Where the server has
-- pg_catalog.uuidv7 nothing is created and the built-in is used.
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE p.proname = 'uuidv7' AND p.pronargs = 0 AND n.nspname IN ('pg_catalog', 'public')
    ) THEN
        -- RFC 9562 UUIDv7: 48-bit Unix ms timestamp, version 7, variant 10, random rest.
        CREATE FUNCTION public.uuidv7() RETURNS uuid
        LANGUAGE sql VOLATILE PARALLEL SAFE
        AS $fn$
            SELECT encode(
                set_bit(
                    set_bit(
                        overlay(uuid_send(gen_random_uuid())
                                placing substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                                FROM 1 FOR 6),
                        52, 1),
                    53, 1),
                'hex')::uuid
        $fn$;
    END IF;
END
$$;
