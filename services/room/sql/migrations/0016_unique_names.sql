-- 0016: names stay unique where people use them, and agents retire, rooms archive.
-- An agent's name is unique within its company, a room's among the rooms its creating company created,
-- both compared as the CLI resolves a name: surrounding whitespace trimmed, case ignored (lower()).
-- Today's duplicates are resolved first without losing a row: names are trimmed, then within each group
-- of equal names the oldest keeps its name and each later one gets a visible suffix, " (2)", " (3)"...,
-- the first number that makes it unique in its group's scope.
ALTER TABLE agents ADD COLUMN retired_at timestamptz;
ALTER TABLE rooms ADD COLUMN archived_at timestamptz;

UPDATE agents SET name = btrim(name, E' \t\n\r\f\v') WHERE name <> btrim(name, E' \t\n\r\f\v');
UPDATE rooms SET name = btrim(name, E' \t\n\r\f\v') WHERE name <> btrim(name, E' \t\n\r\f\v');

DO $$
DECLARE
    dup record;
    n integer;
    candidate text;
BEGIN
    FOR dup IN
        SELECT agent_id, company_id, name FROM (
            SELECT agent_id, company_id, name,
                row_number() OVER (PARTITION BY company_id, lower(name) ORDER BY pos) AS k
            FROM agents
        ) AS d WHERE k > 1 ORDER BY company_id, lower(name), k
    LOOP
        n := 2;
        LOOP
            candidate := dup.name || ' (' || n || ')';
            EXIT WHEN NOT EXISTS (
                SELECT 1 FROM agents WHERE company_id = dup.company_id AND lower(name) = lower(candidate)
            );
            n := n + 1;
        END LOOP;
        UPDATE agents SET name = candidate WHERE agent_id = dup.agent_id;
    END LOOP;
    FOR dup IN
        SELECT room_id, created_by_company_id, name FROM (
            SELECT room_id, created_by_company_id, name,
                row_number() OVER (PARTITION BY created_by_company_id, lower(name) ORDER BY created_at, room_id) AS k
            FROM rooms
        ) AS d WHERE k > 1 ORDER BY created_by_company_id, lower(name), k
    LOOP
        n := 2;
        LOOP
            candidate := dup.name || ' (' || n || ')';
            EXIT WHEN NOT EXISTS (
                SELECT 1 FROM rooms
                WHERE created_by_company_id = dup.created_by_company_id AND lower(name) = lower(candidate)
            );
            n := n + 1;
        END LOOP;
        UPDATE rooms SET name = candidate WHERE room_id = dup.room_id;
    END LOOP;
END
$$;

CREATE UNIQUE INDEX agents_company_name ON agents (company_id, lower(name));
CREATE UNIQUE INDEX rooms_creator_name ON rooms (created_by_company_id, lower(name));
