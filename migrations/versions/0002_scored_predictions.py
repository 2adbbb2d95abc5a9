"""scored_predictions table

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "scored_predictions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("estimator", sa.String(32), nullable=False),
        sa.Column("horizon", sa.Integer(), nullable=False),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("p_fin", sa.Float(), nullable=False),
        sa.Column("c_hat", sa.Float(), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
        sa.Column("realized", sa.Float(), nullable=False),
        sa.Column("hit", sa.Boolean(), nullable=False),
        sa.Column("scored_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("scored_predictions")
