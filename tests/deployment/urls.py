"""URLs of the site gunicorn serves in the deployment tests."""

from django.urls import path

from tests.deployment import views

urlpatterns = [
    path("order/<str:alias>/<str:db>/<str:name>/", views.order, name="deployment-order"),
]
