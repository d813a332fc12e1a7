-- lr schema v1: the site's identity and the registry of streams.

CREATE TABLE lr.site_info (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    site_id    text NOT NULL CHECK (site_id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    region     text NOT NULL DEFAULT 'default',
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Registry of streams (seed 002): routing queues and federated tables known on this site.
-- Receive queues LRQ_Recv_<client>_<source> are registered here so subscribers find them by prefix.
CREATE TABLE lr.registry (
    stream_name   text PRIMARY KEY,
    kind          text NOT NULL CHECK (kind IN ('send_queue', 'receive_queue', 'table')),
    is_federated  boolean NOT NULL DEFAULT false,
    stream_tags   text[] NOT NULL DEFAULT '{}',
    registered_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO lr.registry (stream_name, kind, stream_tags) VALUES
    ('LRQ_Send_LogEntries', 'send_queue', '{}'),
    ('LRQ_Send_SnapSync', 'send_queue', '{}');
