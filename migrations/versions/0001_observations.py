"""observations table

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "observations",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("prompt_key", sa.String(256), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("censored", sa.Boolean(), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("batch", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_observations_batch", "observations", ["batch"])


def downgrade() -> None:
    op.drop_index("ix_observations_batch", table_name="observations")
    op.drop_table("observations")
