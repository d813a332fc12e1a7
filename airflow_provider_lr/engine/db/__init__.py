"""The PostgreSQL underneath every site: connecting, call deadlines, schema migrations, durability rules."""
