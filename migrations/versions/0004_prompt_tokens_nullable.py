"""observations.prompt_tokens may be unknown (NULL)

Before, an observation without ``prompt_tokens`` was stored as 0, which a feature-conditional
estimator would read as a real, empty prompt. Existing rows keep their values.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("observations") as batch:  # SQLite rebuilds the table
        batch.alter_column("prompt_tokens", existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    op.execute("UPDATE observations SET prompt_tokens = 0 WHERE prompt_tokens IS NULL")
    with op.batch_alter_table("observations") as batch:
        batch.alter_column("prompt_tokens", existing_type=sa.Integer(), nullable=False)
