-- Whether a person's name was verified: the issuer of the company's OpenID provider that vouched for
-- the person at sign-in, or NULL when the company's service stated the name (a company API key).
ALTER TABLE messages ADD COLUMN author_verified_by text;
ALTER TABLE tasks ADD COLUMN from_verified_by text;
ALTER TABLE held_actions ADD COLUMN decided_by_verified_by text;
